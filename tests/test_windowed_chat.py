"""Gemma's chat in `plait generate --chat`: a tiny Gemma 2 folder with Gemma's tokenizer
shape and chat template (tests/chat_families.py; the prompt ends in `<start_of_turn>model`)
and its generation_config.json listing `<end_of_turn>` as a stop id, as Gemma ships it;
plait prints what transformers' greedy `generate` writes up to the first stop id. Mistral's
[INST] template and Gemma's prepared targets: tests/test_chat_tokens.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from chat_families import gemma_folder
from hf_models import gemma2_config, save
from plait.models.generate import stop_ids
from test_generate_templates import _hf_greedy, _plait

END_OF_TURN = 5  # gemma_folder's <end_of_turn>


def test_gemma_chat_stops_at_end_of_turn_as_transformers(tmp_path, capsys) -> None:
    from transformers import AutoTokenizer

    folder = gemma_folder(tmp_path / "gemma")
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok.convert_tokens_to_ids("<end_of_turn>") == END_OF_TURN
    config = gemma2_config(len(tok), bos_token_id=2, eos_token_id=[1, END_OF_TURN])
    save(config, folder, seed=5)
    assert stop_ids(1, folder) == [1, END_OF_TURN]
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids).endswith("<start_of_turn>model\n")
    flags = ["--chat", "--prompt", "What is 2+2?", "--max-new-tokens", "12"]
    theirs = _hf_greedy(folder, ids, 12)
    assert _plait(capsys, folder, *flags) == tok.decode(theirs, skip_special_tokens=True) + "\n"
    free = json.loads((Path(folder) / "generation_config.json").read_text())
    assert END_OF_TURN in free["eos_token_id"]
