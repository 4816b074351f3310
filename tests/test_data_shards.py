"""Tokenizers and token shards: prepare is exact, streaming and worker-independent; training
from shards equals training from the same tokens in memory; bad input fails early (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.build.corpus import corpus_from_tokens
from plait.cli import main
from plait.data import load_tokens
from plait.data.prepare import PrepareJob, prepare
from plait.data.shards import ShardStream, read_index
from plait.data.sources import iter_texts, source_files
from plait.data.tokenizer import BYTE_EOS, Encoder, resolve_tokenizer, train_bpe
from plait.errors import ConfigError
from plait.preflight import follow_tokenizer
from reference import reference_run, small_config

STDLIB_PART = Path(json.__file__).parent  # a few small stdlib files: fast to train on


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """A 300-token BPE trained on the json package, and its shards: small shards and small
    pieces, so windows cross shard files and files cross pieces."""
    root = tmp_path_factory.mktemp("data")
    files = source_files(str(STDLIB_PART))
    spec = train_bpe(iter_texts(files, "text"), 300, root / "tok.json", None, False)
    job = PrepareJob(str(STDLIB_PART), root / "shards", str(root / "tok.json"),
                     shard_tokens=5_000, piece_bytes=4_000)  # fmt: skip
    index = prepare(job)
    return {"root": root, "spec": spec, "index": index, "files": files}


def test_tokenizer_and_index(made) -> None:
    spec, index = made["spec"], made["index"]
    assert spec.vocab_size == 300 and spec.dtype == np.uint16
    assert resolve_tokenizer(made["root"] / "tok.json") == spec
    assert index["tokenizer"]["sha256"] == spec.identity
    assert [s["path"] for s in index["sources"]] == [str(f) for f in made["files"]]
    assert len(index["shards"]) == -(-index["tokens"] // 5_000) > 2
    stream = ShardStream(made["root"] / "shards").read(0, index["tokens"])
    # one end-of-document token between files, and each file decodes back to its text
    assert (stream == spec.eos_id).sum() == len(made["files"]) - 1 == index["documents"] - 1
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(made["root"] / "tok.json"))
    first = stream[: int(np.argmax(stream == spec.eos_id))]
    assert tok.decode(first.tolist()) == made["files"][0].read_text()


def test_two_workers_write_the_same_shards(made, tmp_path) -> None:
    job = PrepareJob(str(STDLIB_PART), tmp_path / "s2", str(made["root"] / "tok.json"),
                     workers=2, shard_tokens=5_000, piece_bytes=4_000)  # fmt: skip
    index = prepare(job)
    assert index["shards"] == made["index"]["shards"]
    for shard in index["shards"]:
        one = (made["root"] / "shards" / shard["file"]).read_bytes()
        assert (tmp_path / "s2" / shard["file"]).read_bytes() == one
    assert not (tmp_path / "s2.partial").exists()


def test_byte_shards_equal_the_raw_text_stream(tmp_path) -> None:
    prepare(PrepareJob(str(STDLIB_PART), tmp_path / "b", piece_bytes=3_000, shard_tokens=7_777))
    stream = ShardStream(tmp_path / "b")
    raw = load_tokens(str(STDLIB_PART), 10**9)
    assert read_index(tmp_path / "b")["dtype"] == "uint16" and ord("\n") == BYTE_EOS
    assert np.array_equal(stream.read(0, len(stream)), raw.astype(np.int64))


def test_training_from_shards_equals_training_in_memory(made) -> None:
    """The same tokens mapped from shards and held in memory: bitwise the same losses."""
    cfg = small_config(steps=4)
    cfg.data.path = str(made["root"] / "shards")
    follow_tokenizer(cfg, None)
    assert cfg.model.vocab_size == 300 and cfg.data.tokenizer_hash == made["spec"].identity
    mapped = ShardStream(cfg.data.path)
    memory = mapped.read(0, len(mapped)).astype(np.uint16)
    corpus_mapped, corpus_memory = corpus_from_tokens(mapped, cfg), corpus_from_tokens(memory, cfg)
    # The same split (evenly spaced blocks, from the length alone) and the same baseline.
    assert corpus_mapped.unigram_baseline == corpus_memory.unigram_baseline
    for side in ("train", "val"):
        a, b = getattr(corpus_mapped, side), getattr(corpus_memory, side)
        every = torch.arange(len(a))
        assert len(a) == len(b) and torch.equal(a.draw(every)[0], b.draw(every)[0])
    losses_mapped = reference_run(cfg, corpus_mapped)[0]
    losses_memory = reference_run(cfg, corpus_memory)[0]
    assert losses_mapped == losses_memory
    assert len(set(losses_mapped)) == 4


def test_jsonl_and_parquet_documents(tmp_path, made) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = ["first document", "second, with é", "third"]
    (tmp_path / "src").mkdir()
    lines = [json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)]
    (tmp_path / "src" / "a.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"body": docs}), tmp_path / "src" / "b.parquet", row_group_size=2)
    tok = str(made["root"] / "tok.json")
    index = prepare(PrepareJob(str(tmp_path / "src"), tmp_path / "o", tok, text_key="body"))
    assert index["documents"] == 6
    encoder = Encoder(made["spec"])
    expected = encoder.encode(docs + docs).astype(np.int64)
    assert np.array_equal(ShardStream(tmp_path / "o").read(0, index["tokens"]), expected)


def _fails(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("plait: error:") == 1
    return " ".join(err.split())


def test_bad_input_is_one_line_and_exit_2(made, tmp_path, capsys) -> None:
    tok, shards = str(made["root"] / "tok.json"), str(made["root"] / "shards")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"other": "no text"}\n')
    out = tmp_path / "never"
    msg = _fails(["data", "prepare", "--data", str(bad), "--out", str(out)], capsys)
    assert f"{bad}:2 has no string field 'text'" in msg
    assert not out.exists() and not Path(f"{out}.partial").exists()
    msg = _fails(["data", "prepare", "--data", str(tmp_path / "nope"), "--out", str(out)], capsys)
    assert "does not exist" in msg
    msg = _fails(["tokenizer", "train", "--data", tok, "--vocab-size", "100", "--out", str(out)],
                 capsys)  # fmt: skip
    assert "vocab_size 100 is too small" in msg
    run = ["train", "--model", "tiny-gpt", "--data", shards, "--out", str(tmp_path / "r")]
    msg = _fails([*run, "--vocab-size", "512"], capsys)
    assert "model.vocab_size 512 does not match the vocabulary of tokenizer" in msg
    assert "300" in msg
    other = tmp_path / "other.json"
    train_bpe(iter(["some other text " * 50]), 280, other, None, False)
    msg = _fails([*run, "--tokenizer", str(other)], capsys)
    assert f"shards {shards!r} were made with tokenizer" in msg and str(other) in msg
    msg = _fails(["data", "prepare", "--data", shards, "--out", shards], capsys)
    assert "exists; add --overwrite" in msg


def test_resume_refuses_another_tokenizer(made, tmp_path) -> None:
    from plait.checkpoint import store

    cfg = small_config()
    saved = cfg.to_dict()
    ckpt = tmp_path / "step-1"
    ckpt.mkdir()
    store.write_manifest(ckpt, {"step": 1, "config": saved})
    cfg.data.path = str(made["root"] / "shards")
    follow_tokenizer(cfg, None)
    now = cfg.to_dict()
    now["data"]["path"] = saved["data"]["path"]
    now["model"] = saved["model"]
    with pytest.raises(ConfigError, match=r"data\.tokenizer_hash=None"):
        store.check_resumable(ckpt, now)


def test_shard_windows_cross_files(made) -> None:
    stream = ShardStream(made["root"] / "shards")
    whole = stream.read(0, len(stream))
    starts = np.array([4_990, 0, 9_999])
    rows = stream.take(starts, 33)
    assert np.array_equal(rows, np.stack([whole[s : s + 33] for s in starts]))
    tail = stream[100:]
    assert len(tail) == len(stream) - 100
    assert torch.equal(torch.from_numpy(tail.read(0, 5)), torch.from_numpy(whole[100:105]))


def test_token_dtype_follows_the_vocabulary() -> None:
    from plait.data.tokenizer import BYTES, TokenizerSpec

    assert BYTES.dtype == np.uint16
    assert TokenizerSpec("t.json", 2**16, 0, "h").dtype == np.uint16
    assert TokenizerSpec("t.json", 2**16 + 1, 0, "h").dtype == np.uint32


def test_a_failure_midway_leaves_nothing_that_looks_complete(tmp_path, monkeypatch) -> None:
    from plait.data import prepare as prepare_module

    real, calls = prepare_module.read_piece, []

    def failing(piece, key):
        calls.append(piece)
        if len(calls) == 3:
            raise OSError("disk went away")
        return real(piece, key)

    monkeypatch.setattr(prepare_module, "read_piece", failing)
    out = tmp_path / "shards"
    with pytest.raises(OSError, match="disk went away"):
        prepare(PrepareJob(str(STDLIB_PART), out, piece_bytes=2_000))
    assert not out.exists() and not (tmp_path / "shards.partial").exists()


def test_export_and_generate_use_the_runs_tokenizer(made, tmp_path, capsys) -> None:
    """A run trained on BPE shards: its Hugging Face export carries the tokenizer (and its
    end-of-document id); generation decodes with it."""
    run = ["--data", str(made["root"] / "shards"), "--model", "tiny-gpt", "--steps", "2",
           "--seq-len", "32", "--global-batch", "2", "--micro-batch", "2", "--eval-batches",
           "1", "--no-progress", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(["train", *run]) == 0
    out = tmp_path / "hf"
    argv = ["export", "--checkpoint", str(tmp_path / "run"), "--format", "hf", "--out", str(out)]
    assert main(argv) == 0
    assert (out / "tokenizer.json").read_bytes() == (made["root"] / "tok.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == made["spec"].eos_id
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "import json",
            "--max-new-tokens", "5"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("import json")
