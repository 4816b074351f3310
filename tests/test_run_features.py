"""What fine-tuners expect from a run: --epochs (steps from the training rows), the learning
rate schedules, --eval-data and --keep-best, the summary's trainable parameters and target
tokens per second. Pure checks first, then launched runs sharing one dp2 world and one pair
of examples folders (the schedules' formulas: test_optim.py)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import in_process
import plait.cli.train as train_command
from instruct_data import LLAMA_TEMPLATE, tokenizer_folder, write_jsonl
from plait.checkpoint import store
from plait.cli import main
from plait.config import OptimConfig, TrainConfig
from plait.data.examples import check_examples
from plait.data.instruct import InstructJob, prepare_examples
from plait.optim import lr_at
from plait.preflight import derive_steps
from plait.telemetry import RunSummary, summary_table

WORDS = ["fox", "dog", "jumps", "over", "the", "lazy", "quick", "brown", "numbers"]


def _rows(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"instruction": " ".join(rng.choice(WORDS, rng.integers(1, 5))), "input": "",
         "output": " ".join(rng.choice(WORDS, rng.integers(2, 12)))}
        for _ in range(n)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tokenizer, training examples (48) and a separate validation set (12), prepared
    alike; an examples folder of another tokenizer."""
    root = tmp_path_factory.mktemp("runfeat")
    tok = tokenizer_folder(root / "tok", LLAMA_TEMPLATE)
    made = {}
    for name, n, seed in (("train", 48, 1), ("held", 12, 2)):
        data = write_jsonl(root / f"{name}.jsonl", _rows(n, seed))
        prepare_examples(InstructJob(str(data), root / name, "alpaca", str(tok)))
        made[name] = root / name
    other = tokenizer_folder(root / "tok2", LLAMA_TEMPLATE)
    text = (other / "tokenizer.json").read_text()
    assert "<|im_stop|>" not in text
    (other / "tokenizer.json").write_text(text.replace("<|im_end|>", "<|im_stop|>"))
    data = write_jsonl(root / "other.jsonl", _rows(12, 3))
    prepare_examples(InstructJob(str(data), root / "other", "alpaca", str(other)))
    made["other"] = root / "other"
    return made


BASE = ["--model", "tiny-llama", "--dp", "2", "--seq-len", "64", "--global-batch", "4",
        "--micro-batch", "1", "--eval-batches", "1", "--no-progress"]  # fmt: skip


def _bad(capsys, *argv: str) -> str:
    """`plait train ARGV` refused before any worker: exit 2, one line."""

    def launch(cfg) -> None:
        raise AssertionError(f"plait train {' '.join(argv)} was not refused")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_command, "launch", launch)
        code = main(["train", *argv])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# --- pure -----------------------------------------------------------------------------------


def test_epochs_count_full_global_batches_and_warmup_ratio_rounds_up() -> None:
    t, o = TrainConfig(epochs=3, global_batch=128), OptimConfig(warmup_ratio=0.03)
    derive_steps(t, o, 52_001)
    assert (t.steps, o.warmup_steps) == (3 * 406, math.ceil(0.03 * 1218)) == (1218, 37)
    derive_steps(t, o, 52_001)  # validated twice: the same
    assert (t.steps, o.warmup_steps) == (1218, 37)
    t, o = TrainConfig(steps=50), OptimConfig(warmup_steps=5)
    derive_steps(t, o, 7)  # neither given: untouched
    assert (t.steps, o.warmup_steps) == (50, 5)


def test_bad_run_lengths_and_schedules_are_one_line(capsys, folders, tmp_path) -> None:
    data = ["--data", str(folders["train"]), "--out", str(tmp_path / "o")]
    err = _bad(capsys, *BASE, *data, "--epochs", "2", "--steps", "10")
    assert err.endswith("--epochs 2 and --steps 10 both set the run's steps (flags or the "
                        "config file's [train]); give one")  # fmt: skip
    err = _bad(capsys, *BASE, *data, "--warmup-ratio", "0.1", "--warmup-steps", "3")
    assert "--warmup-ratio 0.1 and --warmup-steps 3 both set the run's warmup steps" in err
    toml = tmp_path / "r.toml"
    toml.write_text("[train]\nsteps = 12\n")
    err = _bad(capsys, *BASE, *data, "--config", str(toml), "--epochs", "1")
    assert "--epochs 1 and --steps 12 both set" in err
    err = _bad(capsys, *BASE, *data, "--lr-schedule", "step")
    assert "lr_schedule must be one of cosine, linear, constant; got 'step'" in err
    err = _bad(capsys, *BASE, *data, "--keep-best", "--no-save")
    assert "--keep-best keeps a checkpoint, but --no-save writes none" in err
    err = _bad(capsys, *BASE, *data, "--keep-best", "--eval-every", "0")
    assert "--eval-every 0 validates only the last step; give --eval-every N" in err
    err = _bad(capsys, *BASE, *data, "--epochs", "-1")
    assert "epochs" in err and "-1" in err


def test_eval_data_must_be_prepared_as_the_training_data(capsys, folders, tmp_path) -> None:
    out = ["--out", str(tmp_path / "o")]
    train = ["--data", str(folders["train"])]
    err = _bad(capsys, *BASE, *train, *out, "--eval-data", str(tmp_path / "nope"))
    assert f"--eval-data {tmp_path / 'nope'} does not exist" in err
    text = tmp_path / "val.txt"
    text.write_text("some text " * 400)
    err = _bad(capsys, *BASE, *train, *out, "--eval-data", str(text))
    assert f"--eval-data {text} is text, but --data {folders['train']} is an examples folder" in err
    err = _bad(capsys, *BASE, *train, *out, "--eval-data", str(folders["other"]))
    assert "prepare both with the same --tokenizer" in err
    err = _bad(capsys, *BASE, *train, *out, "--eval-data", str(folders["held"]), "--seq-len",
               "4", "--long", "drop")  # fmt: skip
    assert "--long drop leaves them all out" in err  # the training rows' cause, named first


def test_eval_data_trains_on_every_example(folders) -> None:
    """Nothing held out of --data; every example of --eval-data validates."""
    split = check_examples(folders["train"], 64, 0.25, False, "truncate", 4)
    whole = check_examples(folders["train"], 64, 0.25, False, "truncate", 4, None,
                           str(folders["held"]))  # fmt: skip
    assert split == (36, 12) and whole == (48, 12)


def test_summary_shows_trainable_parameters_and_target_tokens_per_second() -> None:
    from rich.console import Console

    s = RunSummary("dp=1", 1000, 3, 64, 1.0, 1.5, 2.0, step_times=[9.0, 0.5, 0.25],
                   trainable_params=40, step_targets=[1, 30, 15], best_step=2,
                   best_val_loss=1.25, best_checkpoint="o/checkpoints/step-2")  # fmt: skip
    assert s.target_tokens_per_s == pytest.approx((30 + 15) / 2 / 0.375)  # not the first step
    text = RunSummary("dp=1", 1000, 3, 64, 1.0, 1.5, 2.0, step_times=[9.0, 0.5, 0.25, 0.3],
                      step_targets=[64] * 4)  # fmt: skip
    assert text.target_tokens_per_s == pytest.approx(text.tokens_per_s)  # every token a target
    console = Console(record=True, width=200)
    console.print(summary_table(s))
    text = console.export_text()
    assert "trainable parameters │ 40 (4.00%)" in text
    assert "target tokens        │ 60 tokens/s" in text
    assert "best validation      │ 1.2500 after step 2 (o/checkpoints/step-2)" in text
    assert s.as_dict()["target_tokens_per_s"] == pytest.approx(60.0)


# --- launched ---------------------------------------------------------------------------


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_epochs_eval_data_and_keep_best_in_one_run_and_its_exact_resume(
    world2, folders, tmp_path
) -> None:
    """--epochs 2 over 48 rows at batch 4 (one example a row) is 24 steps, said first; the
    linear schedule runs; every validation reads --eval-data; the best one's checkpoint
    outlives pruning and best.json and the summary name it; resumed from a middle
    checkpoint the run repeats its losses and picks the same best."""
    out = tmp_path / "run"
    argv = [*BASE, "--data", str(folders["train"]), "--eval-data", str(folders["held"]),
            "--no-pack", "--epochs", "2", "--lr-schedule", "linear", "--warmup-ratio", "0.1",
            "--lr", "3e-2", "--min-lr", "0", "--eval-every", "3", "--keep-best",
            "--keep-checkpoints", "1", "--save-every", "12", "--out", str(out)]  # fmt: skip
    code, err = in_process.train(world2, argv)
    assert code == 0, err[-3000:]
    assert "2 epochs of 48 training rows at global batch 4: 12 steps an epoch, 24 steps; " \
        "warmup 3 steps" in err  # fmt: skip
    assert "packed" not in err and "48 + 12 --eval-data examples into 48 training and 12 " \
        "validation rows" in err  # fmt: skip
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(24))
    o = OptimConfig(warmup_steps=3, lr=3e-2, min_lr=0.0, lr_schedule="linear")
    assert [r["lr"] for r in rows] == pytest.approx([lr_at(k, o, 24) for k in range(24)])
    val = {r["step"] + 1: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(val) == [3, 6, 9, 12, 15, 18, 21, 24]
    best = min(val, key=lambda k: (val[k], k))
    # Which step is best is the data's business (pruning that spares an earlier best:
    # test_checkpoint.py::test_prune_spares_the_best_checkpoint).
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["epochs"], summary["best_step"]) == (24, 2, best)
    assert summary["best_val_loss"] == val[best]
    assert summary["trainable_params"] == summary["params"] > 0
    assert summary["target_tokens_per_s"] > 0
    assert store.read_best(out) == {"step": best, "val_loss": val[best],
                                    "checkpoint": str(store.step_dir(out, best))}  # fmt: skip
    kept = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert kept == sorted({f"step-{best}", "step-24"})
    assert "best validation" in err and f"after step {best}" in err
    # The same run kept whole, cut back to its step-12 checkpoint (as if killed after it) and
    # resumed: the same losses, the same best.
    again = tmp_path / "again"
    _resumed_at(again, [*argv[:-2], "--out", str(again), "--keep-checkpoints", "20"], 12, world2)
    resumed = _metrics(again)
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in rows], rel=1e-5)
    again_val = {r["step"] + 1: r["val_loss"] for r in resumed if "val_loss" in r}
    assert again_val == pytest.approx(val, rel=1e-5)
    assert json.loads((again / "summary.json").read_text())["best_step"] == best


def _resumed_at(out: Path, argv: list[str], step: int, world) -> None:
    """Run `argv`, remove its checkpoints after `step`, resume from `step`'s."""
    code, err = in_process.train(world, argv)
    assert code == 0, err[-3000:]
    for later in (out / "checkpoints").glob("step-*"):
        if int(later.name.removeprefix("step-")) > step:
            shutil.rmtree(later)
    code, err = in_process.train(world, [*argv, "--resume", str(store.step_dir(out, step))])
    assert code == 0, err[-3000:]
    assert f"resuming from {store.step_dir(out, step)} at step {step}" in err


def test_text_eval_data_trains_on_every_window(tmp_path) -> None:
    """Text: every window of --data trains (no held-out blocks), every window of --eval-data
    validates; the config's count (what --epochs divides) is the corpus's."""
    from plait.build.corpus import load_corpus
    from plait.preflight import check_run, configure

    train, held = tmp_path / "train.txt", tmp_path / "held.txt"
    train.write_bytes(bytes(range(97, 123)) * 31)  # 806 bytes: 24 windows of 33
    held.write_bytes(b"0123456789" * 16)  # 160 bytes: 4 windows
    run = {"seq_len": 33, "global_batch": 4, "micro_batch": 4, "epochs": 2}
    data = {"path": str(train), "eval_data": str(held)}
    cfg = configure("tiny-gpt", {"train": run, "data": data})
    check_run(cfg)
    corpus = load_corpus(cfg)
    assert (len(corpus.train), len(corpus.val)) == (24, 4)
    assert cfg.train.steps == 2 * (24 // 4)
    for rows, text in ((corpus.train, train.read_bytes()), (corpus.val, held.read_bytes())):
        x, y, _ = rows.draw(torch.arange(len(rows)))
        for i in range(len(rows)):
            assert bytes(x[i].tolist()) == text[33 * i : 33 * i + 33]
            assert bytes(y[i].tolist()) == text[33 * i + 1 : 33 * i + 34]
