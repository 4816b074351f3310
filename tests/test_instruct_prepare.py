"""`plait data prepare --format alpaca|chat`: tokens and targets equal the transformers-based
reference (Stanford's recipe: prompt ids, response ids + EOS, -100 on the prompt; chat: the
template's text with only assistant turns as targets), written as memory-mapped shards with
target masks and example offsets; `--columns` and `--train-on-input`; the summary lines."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from instruct_data import (
    CHATML_TEMPLATE,
    CHATS,
    LLAMA_TEMPLATE,
    ROWS,
    tokenizer_folder,
    write_jsonl,
)
from plait.cli import main
from plait.data.instruct import InstructJob, prepare_examples
from plait.data.shards import ShardStream, read_index
from plait.data.templates import alpaca_prompt


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tokenizer_folder(tmp_path_factory.mktemp("llama"), LLAMA_TEMPLATE)


def _examples(folder: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each example's tokens and mask, read back from the shards through the offsets."""
    index = read_index(folder)
    tokens, mask = ShardStream(folder), ShardStream(folder, key="mask", dtype="uint8")
    offsets = np.fromfile(folder / index["examples"]["offsets"], dtype="<i8")
    return [(tokens.read(a, b), mask.read(a, b)) for a, b in itertools.pairwise(offsets)]


def _stanford(tok, row: dict) -> tuple[list[int], list[int]]:
    """Stanford's train.py with the pieces tokenized apart: input_ids and labels."""
    prompt = [tok.bos_token_id] + tok(alpaca_prompt(row["instruction"], row.get("input")),
                                      add_special_tokens=False)["input_ids"]  # fmt: skip
    response = tok(row["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return prompt + response, [-100] * len(prompt) + response


def test_alpaca_equals_stanfords_tokens_and_labels(llama, tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(llama))
    data = tmp_path / "alpaca.json"
    data.write_text(json.dumps(ROWS, indent=2))  # a JSON array, as alpaca_data.json
    out = tmp_path / "sft"
    index = prepare_examples(InstructJob(str(data), out, "alpaca", str(llama), shard_tokens=7))
    assert index["kind"] == "examples" and len(index["shards"]) > 1  # masks cut alike
    got = _examples(out)
    meta = index["examples"]
    assert meta["count"] == len(ROWS) == index["documents"]
    for row, (tokens, mask), length, first, count in zip(
        ROWS, got, meta["lengths"], meta["first_target"], meta["targets"], strict=True
    ):
        ids, labels = _stanford(tok, row)
        assert tokens.tolist() == ids
        assert np.where(mask > 0, tokens, -100).tolist() == labels
        targets = [i for i, x in enumerate(labels) if x != -100]
        assert (length, first, count) == (len(ids), targets[0], len(targets))
    assert index["tokens"] == sum(meta["lengths"])
    assert meta["target_tokens"] == sum(meta["targets"])
    assert meta["template"]["name"] == "alpaca" and index["tokenizer"]["sha256"]


def test_train_on_input_and_columns(llama, tmp_path) -> None:
    renamed = [{"prompt": r["instruction"], "context": r.get("input", ""),
                "completion": r["output"]} for r in ROWS]  # fmt: skip
    data = write_jsonl(tmp_path / "r.jsonl", renamed)
    cols = "instruction=prompt,input=context,output=completion"
    out = tmp_path / "all"
    prepare_examples(InstructJob(str(data), out, "alpaca", str(llama), columns=cols,
                                 train_on_input=True))  # fmt: skip
    plain = tmp_path / "plain"
    prepare_examples(InstructJob(str(write_jsonl(tmp_path / "p.jsonl", ROWS)), plain, "alpaca",
                                 str(llama)))  # fmt: skip
    for (t1, m1), (t2, m2) in zip(_examples(out), _examples(plain), strict=True):
        assert t1.tolist() == t2.tolist()
        assert m1[0] == 0 and m1[1:].all()  # every token but the first is a target
        assert m2.sum() < m1.sum()


@pytest.mark.parametrize("template", [LLAMA_TEMPLATE, CHATML_TEMPLATE])
def test_chat_targets_are_the_assistant_turns(template, tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    folder = tokenizer_folder(tmp_path / "tok", template)
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS])
    out = tmp_path / "chat"
    index = prepare_examples(InstructJob(str(data), out, "chat", str(folder)))
    assert index["examples"]["template"]["sha256"]
    for chat, (tokens, mask) in zip(CHATS, _examples(out), strict=True):
        text = tok.apply_chat_template(chat, tokenize=False)
        # the BOS comes from the template's own text (Llama) or first (ChatML has none in
        # its text, and the tokenizer defines one)
        assert tok.decode(tokens.tolist()) == (text if text.startswith("<s>") else "<s>" + text)
        said = tok.decode(tokens[mask > 0].tolist())
        answers = [m["content"] for m in chat if m["role"] == "assistant"]
        assert all(a in said for a in answers)
        assert "user" not in said and "[INST]" not in said and "Be brief" not in said
        assert mask.sum() == sum(
            len(tok(t, add_special_tokens=False)["input_ids"]) for t in _assistant_texts(tok, chat)
        )


def _assistant_texts(tok, chat: list[dict]) -> list[str]:
    """The reference cut: the text each assistant turn adds after the generation prompt."""
    out = []
    for i, m in enumerate(chat):
        if m["role"] == "assistant":
            before = tok.apply_chat_template(chat[:i], tokenize=False, add_generation_prompt=True)
            upto = tok.apply_chat_template(chat[: i + 1], tokenize=False)
            out.append(upto[len(before) :])
    return out


def test_cli_prints_examples_tokens_targets_and_lengths(llama, tmp_path, capsys) -> None:
    data = write_jsonl(tmp_path / "a.jsonl", ROWS * 4)
    out = tmp_path / "o"
    argv = ["data", "prepare", "--format", "alpaca", "--data", str(data), "--tokenizer",
            str(llama), "--out", str(out), "--seq-len", "40", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    meta = read_index(out)["examples"]
    tokens, targets = sum(meta["lengths"]), meta["target_tokens"]
    assert f"12 alpaca examples, {tokens:,} tokens, {targets:,} target tokens" in lines[0]
    longer = sum(n > 41 for n in meta["lengths"])
    assert lines[1].startswith(f"at seq_len 40: {longer} of 12 examples are longer than 41")
    assert longer and "truncated" in lines[1]
    assert main([*argv, "--overwrite", "--long", "drop"]) == 0
    assert "would be dropped" in capsys.readouterr().out


def test_bos_follows_the_tokenizer_config(tmp_path) -> None:
    from plait.data.tokenizer import resolve_tokenizer

    named = tokenizer_folder(tmp_path / "named", None)
    usual = tokenizer_folder(tmp_path / "usual", None)
    (usual / "tokenizer_config.json").write_text("{}")  # no names: the usual <s>, </s>
    gpt2 = tokenizer_folder(tmp_path / "gpt2", None, add_bos_token=False)
    bos = resolve_tokenizer(named).bos_id
    assert bos is not None and resolve_tokenizer(usual).bos_id == bos
    assert resolve_tokenizer(gpt2).bos_id is None
    data = write_jsonl(tmp_path / "a.jsonl", ROWS[:1])
    prepare_examples(InstructJob(str(data), tmp_path / "with", "alpaca", str(named)))
    prepare_examples(InstructJob(str(data), tmp_path / "without", "alpaca", str(gpt2)))
    with_bos, m1 = _examples(tmp_path / "with")[0]
    without, m2 = _examples(tmp_path / "without")[0]
    assert with_bos[0] == bos and with_bos[1:].tolist() == without.tolist()
    assert m1[1:].tolist() == m2.tolist()  # the prompt's first token is no target either way
    assert m1.sum() == m2.sum() and read_index(tmp_path / "without")["examples"]["bos_id"] is None
