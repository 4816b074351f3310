"""`plait data prepare --format alpaca|chat`: tokens and targets equal the transformers-based
reference (Stanford's train.py construction; chat: apply_chat_template's tokens with the
assistant turns as targets, tests/chat_reference.py), written as memory-mapped shards with
target masks and example offsets; `--columns` and `--train-on-input`; the summary lines.
Every tokenizer family's shape: test_chat_tokens.py."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from chat_reference import chat_labels, stanford
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
from plait.data.tokenizer import resolve_tokenizer


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tokenizer_folder(tmp_path_factory.mktemp("llama"), LLAMA_TEMPLATE)


def _examples(folder: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each example's tokens and mask, read back from the shards through the offsets."""
    index = read_index(folder)
    tokens, mask = ShardStream(folder), ShardStream(folder, key="mask", dtype="uint8")
    offsets = np.fromfile(folder / index["examples"]["offsets"], dtype="<i8")
    return [(tokens.read(a, b), mask.read(a, b)) for a, b in itertools.pairwise(offsets)]


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
        ids, labels = stanford(tok, row)
        assert tokens.tolist() == ids
        assert np.where(mask > 0, tokens.astype(np.int64), -100).tolist() == labels
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
        ids, labels = chat_labels(tok, chat)
        assert tokens.tolist() == ids  # no BOS the template does not write (ChatML)
        assert np.where(mask > 0, tokens.astype(np.int64), -100).tolist() == labels
        said = tok.decode(tokens[mask > 0].tolist())
        answers = [m["content"] for m in chat if m["role"] == "assistant"]
        assert all(a in said for a in answers)
        assert "user" not in said and "[INST]" not in said and "Be brief" not in said


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


def test_bos_follows_transformers_rule(tmp_path) -> None:
    """The BOS an Alpaca example starts with is the one transformers' tokenizer adds:
    tokenizer.json's post-processor's (transformers 5 ignores tokenizer_config.json's
    add_bos_token where a tokenizer.json exists)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    def folder(name: str, post: bool, **config) -> Path:
        made = tokenizer_folder(tmp_path / name, None, **config)
        if post:
            tok = Tokenizer.from_file(str(made / "tokenizer.json"))
            tok.post_processor = processors.TemplateProcessing(
                single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
            )
            tok.save(str(made / "tokenizer.json"))
        return made

    cases = {"plain": folder("plain", False), "post": folder("post", True),
             "flag": folder("flag", False, add_bos_token=True),
             "off": folder("off", True, add_bos_token=False)}  # fmt: skip
    data = write_jsonl(tmp_path / "a.jsonl", ROWS[:1])
    bos = resolve_tokenizer(cases["post"]).bos_id
    assert bos is not None and resolve_tokenizer(cases["off"]).bos_id == bos
    for name, made in cases.items():
        out = tmp_path / f"out-{name}"
        prepare_examples(InstructJob(str(data), out, "alpaca", str(made)))
        ((tokens, _),) = _examples(out)
        want = stanford(PreTrainedTokenizerFast.from_pretrained(str(made)), ROWS[0])[0]
        assert tokens.tolist() == want, name
        adds = name in ("post", "off")
        assert (tokens[0] == bos) == adds
        assert read_index(out)["examples"]["bos_id"] == (bos if adds else None)
