"""`plait eval` in one process against `transformers` itself (fp32), and its bad input.

Tiny Llama and GPT-2 models are built from configs (random weights) with the instruction
tests' BPE (tests/instruct_data.py) saved into their folders, so `--init-from DIR` brings its
tokenizer. The reference is built from transformers alone (tests/chat_reference.py):
Stanford's train.py construction, or apply_chat_template's tokens with the assistant turns
as labels, cross entropy summed over every target token of every example and divided by
their count. Several examples of different lengths
pack into shared rows (and `--no-pack` gives the same). A checkpoint source equals its
exported folder; bad input stops before any worker. Multi-rank layouts: test_eval_world.py.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from chat_reference import chat_labels, stanford  # noqa: E402
from eval_cases import EXAMPLES, SEQ, evaluate, family, model_folder  # noqa: E402
from hf_models import hf_model, save  # noqa: E402
from instruct_data import CHATS, TEXT, tokenizer_folder, write_jsonl  # noqa: E402
from plait.cli import main  # noqa: E402

RTOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval-models")
    return {kind: model_folder(root / kind, kind) for kind in ("llama", "gpt2")}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("eval-data") / "rows.jsonl", EXAMPLES)


def _tokenizer(folder: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def _loss(folder: Path, examples: list[tuple[list[int], list[int]]]) -> tuple[float, int]:
    """transformers' cross entropy over each (input_ids, labels) alone: summed over every
    target token of every example, divided by their count; and that count."""
    model = hf_model(folder)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in examples:
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
            target = torch.tensor(labels[1:])
            total += torch.nn.functional.cross_entropy(
                logits, target, ignore_index=-100, reduction="sum"
            ).item()
            count += int((target != -100).sum())
    return total / count, count


@pytest.fixture(autouse=True)
def _own_tempdir(tmp_path, monkeypatch) -> None:
    """Eval's scratch folders go under this test's own folder: other runs sharing /tmp (a
    second suite, another session) made and removed theirs under the check's feet."""
    own = tmp_path / "tempdir"
    own.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(own))


def _scratch() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("plait-eval-*")}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_alpaca_loss_is_transformers_packed_and_padded(folders, rows, kind, capsys) -> None:
    tok = _tokenizer(folders[kind])
    want, count = _loss(folders[kind], [stanford(tok, r) for r in EXAMPLES])
    before = _scratch()
    base = ["--init-from", str(folders[kind]), "--data", str(rows), "--format", "alpaca",
            "--seq-len", str(SEQ)]  # fmt: skip
    packed = evaluate(base, capsys)
    assert _scratch() == before  # the temporary examples folder is gone
    assert packed["rows"] < len(EXAMPLES)  # examples shared rows
    padded = evaluate([*base, "--no-pack"], capsys)
    assert padded["rows"] == len(EXAMPLES)
    for got in (packed, padded):
        assert got["loss"] == pytest.approx(want, rel=RTOL)
        assert (got["target_tokens"], got["examples"]) == (count, len(EXAMPLES))
        assert got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-12)
        assert (got["truncated"], got["dropped"]) == (0, 0)


def test_chat_loss_is_transformers_over_the_assistant_turns(folders, tmp_path, capsys) -> None:
    tok = _tokenizer(folders["llama"])
    want, count = _loss(folders["llama"], [chat_labels(tok, c) for c in CHATS])
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])
    got = evaluate(["--init-from", str(folders["llama"]), "--data", str(data), "--format",
                    "chat", "--seq-len", str(SEQ)], capsys)  # fmt: skip
    assert got["loss"] == pytest.approx(want, rel=RTOL)
    assert (got["target_tokens"], got["examples"]) == (count, len(CHATS))


def test_text_is_the_mean_over_every_window(folders, tmp_path, capsys) -> None:
    """A text file, tokenized with the folder's tokenizer (the default), cut into windows of
    seq_len + 1 tokens at a stride of seq_len: every window's every next token."""
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT[0] * 2)
    seq = 32
    ids = _tokenizer(folders["gpt2"])(text.read_text(), add_special_tokens=False)["input_ids"]
    windows = [ids[i * seq : i * seq + seq + 1] for i in range((len(ids) - 1) // seq)]
    want, count = _loss(folders["gpt2"], [(w, w) for w in windows])
    got = evaluate(["--init-from", str(folders["gpt2"]), "--data", str(text), "--format", "text",
                    "--seq-len", str(seq)], capsys)  # fmt: skip
    assert got["loss"] == pytest.approx(want, rel=RTOL)
    assert (got["target_tokens"], got["examples"]) == (count, len(windows)) == (count, count // seq)


def _bad(argv: list[str], capsys) -> str:
    """Exit 2 and one line on stderr, before any worker (none is started: a world of one
    would print its banner on stdout) and with no temporary folder left behind."""
    before = _scratch()
    code = main(["eval", *argv])
    out = capsys.readouterr()
    assert code == 2, out.err
    assert out.out == "" and len(out.err.strip().splitlines()) == 1, out.err
    assert _scratch() == before
    return " ".join(out.err.split())


def test_bad_input_stops_before_workers(folders, rows, tmp_path, capsys) -> None:
    llama = str(folders["llama"])
    alpaca = ["--data", str(rows), "--format", "alpaca", "--seq-len", str(SEQ)]
    text = tmp_path / "t.txt"
    text.write_text(TEXT[0])
    bare = tmp_path / "bare"  # a model folder without a tokenizer
    save(family("llama"), bare)
    capsys.readouterr()  # transformers' progress bar
    bad_row = write_jsonl(tmp_path / "bad.jsonl", [*EXAMPLES[:2], {"instruction": "x"}])
    cases = [
        (["--checkpoint", str(tmp_path), "--model", "tiny-llama", *alpaca],
         "--checkpoint names the model; leave out --model"),
        (alpaca, "plait eval needs a model: --init-from HF_DIR or --checkpoint CK"),
        (["--init-from", str(tmp_path / "nowhere"), *alpaca], "nowhere is not a folder"),
        (["--init-from", str(bare), *alpaca], "--format alpaca needs a tokenizer"),
        (["--init-from", llama, "--data", str(text), "--columns", "output=completion"],
         "--columns is for --format alpaca or chat, not text"),
        (["--init-from", llama, "--data", str(text), "--format", "text", "--chat-template",
          str(text)], "--chat-template is for --format alpaca or chat, not text"),
        (["--init-from", llama, "--data", str(text), "--train-on-input"],
         "--train-on-input is for --format alpaca or chat, not text"),
        (["--init-from", llama, *alpaca, "--dp", "4"],
         f"rows of seq_len {SEQ}, fewer than dp 4 replicas; lower --dp"),
        (["--init-from", llama, "--data", str(rows), "--format", "alpaca", "--seq-len", "3",
          "--long", "drop"], f"data '{rows}' gives no rows of seq_len 3: every one of the"),
        (["--init-from", llama, "--data", str(tmp_path / "missing.jsonl"), "--format", "alpaca"],
         "missing.jsonl"),
        (["--init-from", llama, "--data", str(bad_row), "--format", "alpaca"], "bad.jsonl:3"),
        *[([*flags, "--init-from", llama, *alpaca], f"{flags[0]} is a training flag; plait eval "
           "trains nothing") for flags in (["--lr", "1e-4"], ["--steps", "3"], ["--no-save"],
                                          ["--epochs", "1"], ["--eval-data", str(rows)],
                                          ["--keep-best"], ["--out", "o"], ["--global-batch", "2"],
                                          ["--val-fraction", "0.5"])],
    ]  # fmt: skip
    for argv, message in cases:
        said = _bad(argv, capsys)
        assert message in said and "plait-eval" not in said, (argv, said)


def test_eval_shows_its_progress(folders, rows, capsys) -> None:
    """Rank 0's bar on stderr, labelled eval, run to its end; --json's stdout stays JSON."""
    got = evaluate(["--init-from", str(folders["llama"]), "--data", str(rows), "--format",
                    "alpaca", "--seq-len", str(SEQ), "--micro-batch", "1"], capsys)  # fmt: skip
    assert got["rows"] > 1
    assert got["stderr"].startswith("eval ")
    assert f" {got['rows']}/{got['rows']} micro-batches per replica" in got["stderr"]


ONE_STEP = ["--steps", "1", "--global-batch", "1", "--micro-batch", "1", "--eval-batches", "1",
            "--no-progress", "--device", "cpu", "--overwrite"]  # fmt: skip


def _train(argv: list[str], capsys) -> None:
    code = main(["train", *argv, *ONE_STEP])
    assert code == 0, capsys.readouterr().err[-3000:]
    capsys.readouterr()


@pytest.fixture(scope="module")
def sft(folders, rows, tmp_path_factory) -> Path:
    """The rows prepared as examples with the Llama folder's tokenizer."""
    out = tmp_path_factory.mktemp("eval-sft") / "sft"
    assert main(["data", "prepare", "--format", "alpaca", "--data", str(rows), "--tokenizer",
                 str(folders["llama"]), "--out", str(out), "--no-progress"]) == 0  # fmt: skip
    return out


def test_a_checkpoint_equals_its_export_and_shards_their_raw_file(
    folders, rows, sft, tmp_path, capsys
) -> None:
    """One step of instruction tuning from the Llama folder: `--checkpoint RUN` (the run's
    tokenizer by default) gives the figure of `--init-from` its exported folder, and not the
    folder's it started from; the prepared shards give the raw file's figure. Once the run's
    data has moved, its tokenizer is unknown: refused, unless --tokenizer names the one the
    run recorded."""
    llama, run, data = str(folders["llama"]), tmp_path / "run", tmp_path / "sft"
    shutil.copytree(sft, data)
    _train(["--init-from", llama, "--data", str(data), "--seq-len", str(SEQ), "--out", str(run),
            "--lr", "1e-2"], capsys)  # fmt: skip
    hf = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run), "--format", "hf", "--out", str(hf)]) == 0
    capsys.readouterr()
    alpaca = ["--data", str(rows), "--format", "alpaca", "--seq-len", str(SEQ)]
    tuned = evaluate(["--checkpoint", str(run), *alpaca], capsys)
    exported = evaluate(["--init-from", str(hf), *alpaca], capsys)  # export copied the tokenizer
    assert tuned["loss"] == pytest.approx(exported["loss"], rel=1e-6)
    assert tuned["target_tokens"] == exported["target_tokens"]
    start = evaluate(["--init-from", llama, *alpaca], capsys)
    assert abs(start["loss"] - tuned["loss"]) > 1e-3  # the step moved it
    shards = evaluate(["--init-from", llama, "--data", str(sft), "--seq-len", str(SEQ)], capsys)
    assert shards == start
    data.rename(tmp_path / "moved")
    said = _bad(["--checkpoint", str(run), *alpaca], capsys)
    assert f"the run of checkpoint {run}/checkpoints/step-1 trained with tokenizer sha256" in said
    assert f"but its data {str(data)!r} now gives bytes (sha256 None): run from the folder" in said
    assert said.endswith("(its paths are relative to it), or give --tokenizer")
    generate = ["generate", "--checkpoint", str(run), "--template", "alpaca", "--prompt", "x"]
    assert main(generate) == 2  # generate and export find the tokenizer the same way
    assert "now gives bytes (sha256 None): run from the folder" in capsys.readouterr().err
    assert evaluate(["--checkpoint", str(run), "--tokenizer", llama, *alpaca], capsys) == tuned
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text((folders["llama"] / "tokenizer.json").read_text() + " ")
    said = _bad(["--checkpoint", str(run), "--tokenizer", str(other), *alpaca], capsys)
    assert f"--tokenizer {other} is not the tokenizer the run of --checkpoint {run}/" in said
    gpt2_sft = tmp_path / "gpt2-sft"  # examples of another tokenizer than the run's
    assert main(["data", "prepare", "--format", "alpaca", "--data", str(rows), "--tokenizer",
                 str(other), "--out", str(gpt2_sft), "--no-progress"]) == 0  # fmt: skip
    capsys.readouterr()
    said = _bad(["--checkpoint", str(run), "--tokenizer", llama, "--data", str(gpt2_sft)], capsys)
    assert f"not with --tokenizer {llama}'s; prepare them again with --tokenizer {llama}" in said


def test_shards_of_another_tokenizer_are_refused_by_eval_and_train(
    folders, rows, sft, tmp_path, capsys
) -> None:
    other = tokenizer_folder(tmp_path / "other", None)  # the same BPE, another file's hash
    gpt2 = save(family("gpt2"), tmp_path / "gpt2")
    (gpt2 / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + " ")
    capsys.readouterr()  # transformers' progress bar
    seq = ["--seq-len", str(SEQ)]
    said = _bad(["--init-from", str(gpt2), "--data", str(sft), *seq], capsys)
    assert f"shards {str(sft)!r} were made with tokenizer" in said
    assert f"not with --init-from {gpt2}'s; prepare them again with --tokenizer {gpt2}" in said
    assert "--format" in _bad(["--init-from", str(folders["llama"]), "--data", str(sft),
                               "--format", "alpaca", *seq], capsys)  # fmt: skip
    train = ["train", "--init-from", str(gpt2), "--data", str(sft), *seq, *ONE_STEP]
    code = main([*train, "--out", str(tmp_path / "r")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and f"were made with tokenizer {folders['llama']}" in err, err
    assert f"not with --init-from {gpt2}'s" in err


def test_a_byte_run_has_no_tokenizer_for_alpaca(rows, tmp_path, capsys) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT[0] * 4)
    run = tmp_path / "bytes"
    _train(["--model", "tiny-gpt", "--data", str(corpus), "--seq-len", "32", "--out", str(run)],
           capsys)  # fmt: skip
    said = _bad(["--checkpoint", str(run), "--data", str(rows), "--format", "alpaca"], capsys)
    assert "--format alpaca needs a tokenizer: give --tokenizer" in said
