"""`plait generate --template alpaca|--chat`: the prompt's tokens are the ones `data prepare`
trained on (one function builds both), decoding stops at the stop ids, the response alone is
printed and equals transformers' greedy `generate` on a tiny Llama; bad flags are one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_models import hf_model, llama_config, save
from instruct_data import CHATML_TEMPLATE, LLAMA_TEMPLATE, tokenizer_folder, write_jsonl
from plait.cli import main
from plait.data.instruct import InstructJob, Tokenized, prepare_examples
from plait.data.shards import ShardStream, read_index
from plait.data.templates import alpaca_prompt
from plait.data.tokenizer import resolve_tokenizer
from plait.models.generate import generate, stop_ids
from plait.models.init import init_parameters
from plait.models.presets import get_preset
from plait.models.transformer import Transformer

ROWS = [
    {"instruction": "Give three tips for staying healthy.", "input": "", "output": "Eat."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
]
CHATS = [
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "more"},
     {"role": "assistant", "content": "ok"}],
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama (ids 0 and 1 are the tokenizer's <s> and </s>) with a ChatML tokenizer."""
    folder = tokenizer_folder(tmp_path_factory.mktemp("hf") / "llama", CHATML_TEMPLATE)
    config = llama_config(vocab=400, bos_token_id=0, eos_token_id=1, initializer_range=0.2)
    return save(config, folder, seed=4)


def _prepared(tmp: Path, fmt: str, rows, folder: Path, on_input: bool) -> list[tuple]:
    """Each prepared example's tokens and its prompt length from the index."""
    data = write_jsonl(tmp / f"{fmt}.jsonl", rows)
    out = tmp / f"{fmt}-{on_input}"
    prepare_examples(InstructJob(str(data), out, fmt, str(folder), train_on_input=on_input))
    meta = read_index(out)["examples"]
    offsets, tokens = np.fromfile(out / meta["offsets"], "<i8"), ShardStream(out)
    if not on_input:  # the prompt ends where the targets start
        assert meta["prompts"] == meta["first_target"]
    return [(tokens.read(int(offsets[i]), int(offsets[i + 1])), meta["prompts"][i])
            for i in range(len(rows))]  # fmt: skip


@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("template", [CHATML_TEMPLATE, LLAMA_TEMPLATE])
def test_prompt_ids_are_the_prepared_examples_prompts(tmp_path, template, on_input) -> None:
    folder = tokenizer_folder(tmp_path / "tok", template)
    spec = resolve_tokenizer(folder)
    alpaca, chat = Tokenized("alpaca", spec), Tokenized("chat", spec)
    made = _prepared(tmp_path, "alpaca", ROWS, folder, on_input)
    for row, (tokens, prompt) in zip(ROWS, made, strict=True):
        assert alpaca.prompt_ids(row).tolist() == tokens[:prompt].tolist()
    made = _prepared(tmp_path, "chat", [{"messages": m} for m in CHATS], folder, on_input)
    for msgs, (tokens, prompt) in zip(CHATS, made, strict=True):
        first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        ids = chat.prompt_ids({"messages": msgs[:first]})
        assert ids.tolist() == tokens[:prompt].tolist()
        # <s> (id 0) only where the template writes it: apply_chat_template adds none
        assert (ids[0] == 0) == (template == LLAMA_TEMPLATE) and spec.bos_id is None


def test_prompt_ids_equal_stanfords_and_transformers_chat_prompt(model_dir) -> None:
    from transformers import AutoTokenizer

    tok, spec = AutoTokenizer.from_pretrained(str(model_dir)), resolve_tokenizer(model_dir)
    row = ROWS[1]
    text = alpaca_prompt(row["instruction"], row["input"])
    assert Tokenized("alpaca", spec).prompt_ids(row).tolist() == tok(text)["input_ids"]
    msgs = CHATS[1][:2]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert Tokenized("chat", spec).prompt_ids({"messages": msgs}).tolist() == want


def test_generation_stops_at_the_first_stop_id_and_leaves_it_out() -> None:
    cfg = get_preset("tiny-llama")
    model = Transformer(cfg)
    init_parameters(model, seed=3)
    prompt = torch.tensor([5, 6, 7])
    free = generate(model, prompt, 16).tolist()
    k = next(i for i in range(2, 16) if free[i] not in free[:i])  # a first occurrence
    assert generate(model, prompt, 16, stop=[free[k], 999]).tolist() == free[:k]
    assert generate(model, prompt, 16, stop=[free[0]]).tolist() == []


def test_stop_ids_follow_generation_config(tmp_path) -> None:
    assert stop_ids(7, None) == [7] and stop_ids(7, tmp_path) == [7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert stop_ids(7, tmp_path) == [2, 9]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert stop_ids(7, tmp_path) == [3]


def _plait(capsys, folder: Path, *flags: str) -> str:
    assert main(["generate", "--init-from", str(folder), *flags]) == 0
    return capsys.readouterr().out


def _hf_greedy(folder: Path, ids: list[int], n: int) -> list[int]:
    """transformers' greedy generate on `ids`, up to (not including) its stop id."""
    model = hf_model(folder)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))  # fmt: skip
    new, stops = out[0, len(ids) :].tolist(), set(stop_ids(-1, folder))
    return next((new[:i] for i, t in enumerate(new) if t in stops), new)


@pytest.mark.parametrize("with_input", [False, True])
def test_alpaca_generate_prints_what_transformers_decodes(model_dir, capsys, with_input):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    given = "2 and 3" if with_input else None
    text = alpaca_prompt("Add the numbers.", given)
    ids = tok(text)["input_ids"]  # Stanford's prompt: the tokenizer's own special tokens
    flags = ["--template", "alpaca", "--prompt", "Add the numbers.", "--max-new-tokens", "12"]
    got = _plait(capsys, model_dir, *flags, *(["--input", given] if given else []))
    want = _hf_greedy(model_dir, ids, 12)
    assert got == tok.decode(want, skip_special_tokens=True) + "\n"


def test_a_stop_id_ends_the_printed_response_as_in_transformers(model_dir, tmp_path, capsys):
    """A random model rarely writes EOS: make one of its greedy tokens a stop id through
    generation_config.json, as a chat model lists its end-of-turn token there."""
    from transformers import AutoTokenizer

    folder = Path(shutil.copytree(model_dir, tmp_path / "stops"))
    tok = AutoTokenizer.from_pretrained(str(folder))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    flags = ["--chat", "--system", "Be brief.", "--prompt", "2+2?", "--max-new-tokens", "12"]
    free = _hf_greedy(folder, ids, 12)
    assert _plait(capsys, folder, *flags) == tok.decode(free, skip_special_tokens=True) + "\n"
    k = next(i for i in range(1, 12) if free[i] not in free[:i])
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = [1, free[k]]
    (folder / "generation_config.json").write_text(json.dumps(config))
    stopped = _hf_greedy(folder, ids, 12)
    assert stopped == free[:k]
    assert _plait(capsys, folder, *flags) == tok.decode(stopped, skip_special_tokens=True) + "\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--template", "alpaca", "--chat"], "--template alpaca and --chat both name"),
        (["--template", "vicuna"], "unknown --template 'vicuna' (known: alpaca; or --chat)"),
        (["--input", "x"], "--input is alpaca's input field: it needs --template alpaca"),
        (["--chat", "--input", "x"], "--input is alpaca's input field"),
        (["--system", "x"], "--system is for chat prompts: it needs --chat"),
        (["--chat-template", "t.jinja"], "--chat-template is for chat prompts"),
        (["--template", "alpaca"], "--template alpaca needs a tokenizer with an end-of-seq"),
        (["--chat"], "--chat needs a tokenizer with an end-of-sequence token; the byte"),
    ],
)
def test_bad_template_flags_are_one_line(tmp_path, capsys, flags, message) -> None:
    """Before any weights are read: the folder holds none."""
    code = main(["generate", "--init-from", str(tmp_path), "--prompt", "hi", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_chat_without_a_template_is_one_line(tmp_path, capsys) -> None:
    folder = tokenizer_folder(tmp_path / "plain", None)
    code = main(["generate", "--init-from", str(folder), "--chat", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--chat needs a chat template" in err and "--chat-template FILE" in err


@pytest.mark.parametrize("on_input", [False, True])
def test_an_instruction_runs_sample_answers_its_first_validation_prompt(tmp_path, on_input):
    """The summary's sample of a run on examples: the first validation example's prompt
    (example 0), the greedy answer, stopping at EOS or the --init-from folder's stop ids."""
    from plait.config import Config
    from plait.text_sample import SAMPLE_TOKENS, instruct_sample

    folder = tokenizer_folder(tmp_path / "tok", CHATML_TEMPLATE)
    spec = resolve_tokenizer(folder)
    data = write_jsonl(tmp_path / "a.jsonl", ROWS * 4)
    out = tmp_path / "sft"
    prepare_examples(InstructJob(str(data), out, "alpaca", str(folder), train_on_input=on_input))
    cfg = Config()
    cfg.data.path, cfg.data.val_fraction = str(out), 0.25
    model_cfg = get_preset("tiny-llama")
    model_cfg.vocab_size, model_cfg.init_std = 400, 0.2
    model = Transformer(model_cfg)
    init_parameters(model, seed=5)
    got = instruct_sample(model, cfg)
    ids = Tokenized("alpaca", spec).prompt_ids(ROWS[0])
    free = generate(model, torch.as_tensor(ids, dtype=torch.long), SAMPLE_TOKENS).tolist()
    assert spec.eos_id not in free  # a random model: its EOS is made below
    tok = Tokenized("alpaca", spec).encoder._tok
    assert got == {"prompt": tok.decode(ids.tolist()), "text": tok.decode(free)}
    assert got["prompt"].startswith("Below is an instruction") and got["text"]
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    hf = tmp_path / "hf"  # a run from --init-from: its generation_config.json's stop ids
    hf.mkdir()
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[k]]}))
    cfg.checkpoint.init_from = str(hf)
    assert instruct_sample(model, cfg)["text"] == tok.decode(free[:k])
