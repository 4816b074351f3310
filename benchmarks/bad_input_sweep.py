"""Wrong input across every command: each must end in one line and exit 2 before any worker
starts (130 or 143 for a signal), with no traceback and nothing left behind.

    PYTHONPATH=src python benchmarks/bad_input_sweep.py [--only CLASS] [--list]

Not a benchmark of speed: it lives here because benchmarks/ holds the scripts run by hand
against the whole package (linted and import-tested with it). The cases run in this process
through `plait.cli.main(argv)` with stderr captured, so the sweep takes seconds, not hours; the
launcher (train, eval, lessons), calibrate's spawn, data prepare's pool and the tokenizer's
training are replaced by a function that raises, so a case that gets that far is counted
as "reached the workers". Signals are sent to a `plait` process of its own paused at its
'start' phase (PLAIT_PAUSE_AT), for every command; the later phases of each long command
(spawn, rendezvous, evaluation, a save, the summary's sample, calibrate, a lesson, data
prepare, tokenizer training) are tests/test_signal_phases.py. tests/test_bad_input_sweep.py
runs a slice of this table. The counts last seen are in docs/running.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

CLASSES = ("wrong value", "wrong path", "wrong type", "conflicting flags", "damaged checkpoint",
           "signals")  # fmt: skip

TINY = ["--model", "tiny-gpt", "--seq-len", "32", "--global-batch", "2", "--micro-batch", "1",
        "--max-bytes", "60000", "--eval-batches", "1", "--steps", "2", "--no-progress"]  # fmt: skip
"""A run small enough to be refused quickly (every case changes one thing of it)."""
FROM_HF = [a for a in TINY if a not in ("--model", "tiny-gpt")]  # --init-from names the model


@dataclass(frozen=True)
class Case:
    cls: str
    argv: tuple[str, ...]  # {S}: the scratch folder (see `scratch`)
    code: int = 2

    @property
    def command(self) -> str:
        words = [w for w in self.argv[:2] if not w.startswith("-")]
        two = ("checkpoint", "data", "tokenizer")
        return " ".join(words[:2]) if words and words[0] in two else words[0]


def _c(cls: str, *argv: str, code: int = 2) -> Case:
    return Case(cls, tuple(argv), code)


def _train(cls: str, *flags: str) -> Case:
    return _c(cls, "train", *TINY, "--out", "{S}/new-run", *flags)


def wrong_values() -> list[Case]:
    v = "wrong value"
    train = [("--lr", "nan"), ("--lr", "inf"), ("--lr", "-1"), ("--beta1", "2"),
             ("--beta2", "-0.5"), ("--weight-decay", "-1"), ("--init-std", "-1"),
             ("--dropout", "1.5"), ("--steps", "0"), ("--dp", "0"), ("--tp", "-2"),
             ("--seq-len", "0"), ("--grad-clip", "-1"), ("--val-fraction", "1.5"),
             ("--max-bytes", "0"), ("--warmup-steps", "-3"), ("--eval-batches", "0"),
             ("--keep-checkpoints", "0"), ("--comm-timeout", "0"), ("--bucket-mb", "nan"),
             ("--model", "no-such-model"), ("--pp", "2", "--schedule", "zigzag"),
             ("--precision", "fp8"),
             ("--nan-policy", "ignore"), ("--recompute", "some"), ("--device", "tpu"),
             ("--zero", "4"), ("--seq-len", "4096"), ("--global-batch", "0"),
             ("--n-heads", "5"), ("--offload", "disk"), ("--dp-mode", "magic")]  # fmt: skip
    cases = [_train(v, *flags) for flags in train]
    cases += [_c(v, "estimate", *args) for args in (
        ["--model", "nope"], ["--dp", "0"], ["--device-memory", "-1"], ["--lr", "nan"],
        ["--tp", "3", "--model", "tiny-gpt"], ["--pp", "99", "--model", "tiny-gpt"],
        ["--zero", "9"], ["--seq-len", "inf"])]  # fmt: skip
    plan = ["plan", "--gpus", "8", "--global-batch", "8", "--seq-len", "64"]
    cases += [_c(v, *plan, *args) for args in (
        ["--model", "nope"], ["--gpu-memory", "0"], ["--top", "0"], ["--hardware", "tpu9"],
        ["--gpus-per-node", "0"], ["--max-micro-batch", "-1"], ["--dp", "0"],
        ["--precision", "fp4"])]  # fmt: skip
    cases += [_c(v, "plan", "--gpus", g, "--global-batch", "8", "--seq-len", "64")
              for g in ("0", "-8", "nan")]  # fmt: skip
    cases += [_c(v, "calibrate", "--out", "{S}/hw.toml", *args) for args in (
        ["--ranks", "1"], ["--ranks", "0"], ["--repeats", "-1"], ["--repeats", "0"],
        ["--model", "nope"], ["--seq-len", "100000"], ["--seq-len", "0"])]  # fmt: skip
    cases += [_c(v, "schedule", *args, "--out", "{S}/sched") for args in (
        ["--pp", "0", "--microbatches", "4"], ["--pp", "2", "--microbatches", "0"],
        ["--pp", "2", "--microbatches", "4", "--schedule", "zigzag"],
        ["--pp", "2", "--microbatches", "3", "--schedule", "interleaved", "--virtual-stages", "2"],
        ["--pp", "2", "--microbatches", "4", "--virtual-stages", "0"])]  # fmt: skip
    cases += [_c(v, "generate", "--checkpoint", "{S}/run", "--prompt", "hi", *args) for args in (
        ["--max-new-tokens", "0"], ["--temperature", "-1"], ["--temperature", "nan"],
        ["--top-k", "-1"])]  # fmt: skip
    cases += [_c(v, "export", "--checkpoint", "{S}/run", "--out", "{S}/hf", *args)
              for args in (["--max-shard-mb", "0"], ["--format", "onnx"])]  # fmt: skip
    cases += [
        _c(v, "data", "prepare", "--data", "{S}/text.txt", "--out", "{S}/shards", *args)
        for args in (["--workers", "0"], ["--shard-tokens", "0"], ["--shard-tokens", "nan"])
    ]
    cases += [_c(v, "data", "instructions", "--out", "{S}/ins.jsonl", *args)
              for args in (["--max-examples", "0"], ["--max-chars", "-5"])]  # fmt: skip
    cases += [_c(v, "tokenizer", "train", "--data", "{S}/text.txt", "--out", "{S}/tok.json",
                 "--vocab-size", n) for n in ("10", "0", "-1", "nan")]  # fmt: skip
    ev = ["eval", "--checkpoint", "{S}/run", "--data", "{S}/text.txt", "--no-progress"]
    cases += [_c(v, *ev, *args) for args in (
        ["--format", "xml"], ["--dp", "0"], ["--seq-len", "nan"], ["--micro-batch", "0"],
        ["--eval-batches", "-1"])]  # fmt: skip
    cases += [
        _c(v, "lessons", "--only", "nope", "--out", "{S}/lessons"),
        _c(v, "lessons", "--only", "dp", "--only", "zzz", "--out", "{S}/lessons"),
    ]
    return cases


def wrong_paths() -> list[Case]:
    p = "wrong path"
    missing, folder, file, proc = "{S}/missing/x", "{S}/folder", "{S}/exists.txt", "/proc/x/y"
    under_file, full = "{S}/exists.txt/x", "{S}/bad-lessons"  # a folder's parent is a file
    cases = [_c(p, "train", *TINY, "--out", out) for out in (under_file, file, proc)]
    cases += [
        _train(p, flag, value)
        for flag, value in (
            ("--data", "{S}/nothing-here"),
            ("--data", "{S}/empty"),
            ("--config", "{S}/no.toml"),
            ("--config", folder),
            ("--tokenizer", "{S}/no-tokenizer.json"),
            ("--tokenizer", "{S}/text.txt"),
            ("--resume", "{S}/no-ckpt"),
            ("--resume", file),
        )
    ]
    cases += [_c(p, "train", *FROM_HF, "--out", "{S}/new-run", "--init-from", hf)
              for hf in ("{S}/no-hf", file)]  # fmt: skip
    cases += [_train(p, "--offload", "nvme", "--offload-dir", proc)]
    plan = ["plan", "--gpus", "8", "--global-batch", "8", "--seq-len", "64"]
    cases += [_c(p, *plan, "--out", out) for out in (missing, folder, proc)]
    cases += [_c(p, *plan, "--hardware", "{S}/no-hw.toml"), _c(p, *plan, "--hardware", folder)]
    cases += [_c(p, "estimate", "--config", c) for c in ("{S}/no.toml", folder)]
    cases += [_c(p, "calibrate", "--out", out) for out in (missing, folder, proc)]
    sched = ["schedule", "--pp", "2", "--microbatches", "4"]
    cases += [_c(p, *sched, "--out", out) for out in (under_file, file, proc)]
    cases += [_c(p, "checkpoint", "info", c) for c in ("{S}/no-ckpt", file, folder)]
    cases += [_c(p, "checkpoint", "consolidate", "{S}/run", "--out", out)
              for out in (missing + ".safetensors", folder, proc, file)]  # fmt: skip
    cases += [_c(p, "export", "--checkpoint", "{S}/run", "--out", out)
              for out in (under_file, full, file, proc)]  # fmt: skip
    cases += [_c(p, "export", "--checkpoint", c, "--out", "{S}/hf") for c in ("{S}/no", file)]
    cases += [_c(p, "generate", "--checkpoint", c, "--prompt", "x") for c in ("{S}/no", file)]
    cases += [_c(p, "generate", "--init-from", c, "--prompt", "x") for c in ("{S}/no", file)]
    prep = ["data", "prepare", "--data", "{S}/text.txt"]
    cases += [_c(p, *prep, "--out", out) for out in (under_file, file, proc)]
    cases += [_c(p, "data", "prepare", "--data", d, "--out", "{S}/shards")
              for d in ("{S}/nothing-here", "{S}/empty")]  # fmt: skip
    cases += [_c(p, *prep, "--out", "{S}/shards", "--tokenizer", "{S}/no-tokenizer.json")]
    cases += [_c(p, "data", "instructions", "--out", out) for out in (missing, folder, proc)]
    cases += [_c(p, "data", "instructions", "--out", "{S}/ins.jsonl", "--source", "{S}/none")]
    tok = ["tokenizer", "train", "--vocab-size", "300"]
    cases += [_c(p, *tok, "--data", "{S}/text.txt", "--out", out)
              for out in (missing, folder, proc)]  # fmt: skip
    cases += [_c(p, *tok, "--data", "{S}/nothing-here", "--out", "{S}/tok.json")]
    ev = ["eval", "--data", "{S}/text.txt", "--checkpoint"]
    cases += [_c(p, *ev, c) for c in ("{S}/no", file)]
    cases += [_c(p, "eval", "--checkpoint", "{S}/run", "--seq-len", "32", "--data", d)
              for d in ("{S}/nothing-here", "{S}/empty")]  # fmt: skip
    cases += [_c(p, "lessons", "--only", "dp", "--out", out) for out in (file, proc)]
    cases += [_c(p, "lessons", "--only", "dp", "--out", "{S}/bad-lessons")]  # unreadable json
    return cases


def wrong_types() -> list[Case]:
    t = "wrong type"
    cases = [_train(t, flag, value) for flag, value in (
        ("--steps", "three"), ("--lr", "fast"), ("--dp", "2.5"), ("--seq-len", "1e3x"),
        ("--config", "{S}/binary.toml"), ("--config", "{S}/bad.toml"),
        ("--config", "{S}/wrong-type.toml"), ("--config", "{S}/unknown-key.toml"),
        ("--stage-layers", "a,b"), ("--data", "{S}/bad.jsonl"),
        ("--tokenizer", "{S}/bad-tokenizer.json"))]  # fmt: skip
    cases += [
        _c(t, "estimate", "--config", "{S}/binary.toml"),
        _c(t, "estimate", "--d-model", "wide"),
        _c(t, "plan", "--gpus", "eight", "--global-batch", "8", "--seq-len", "64"),
        _c(
            t,
            "plan",
            "--gpus",
            "8",
            "--global-batch",
            "8",
            "--seq-len",
            "64",
            "--hardware",
            "{S}/binary.toml",
        ),
        _c(
            t,
            "plan",
            "--gpus",
            "8",
            "--global-batch",
            "8",
            "--seq-len",
            "64",
            "--hardware",
            "{S}/bad.toml",
        ),
        _c(t, "calibrate", "--ranks", "two", "--out", "{S}/hw.toml"),
        _c(t, "schedule", "--pp", "two", "--microbatches", "4"),
        _c(t, "generate", "--checkpoint", "{S}/run", "--prompt", "x", "--top-k", "k"),
        _c(t, "export", "--checkpoint", "{S}/run", "--out", "{S}/hf", "--max-shard-mb", "x"),
        _c(t, "data", "prepare", "--data", "{S}/bad.jsonl", "--out", "{S}/shards"),
        _c(
            t,
            "data",
            "prepare",
            "--data",
            "{S}/text.txt",
            "--out",
            "{S}/shards",
            "--workers",
            "many",
        ),
        _c(
            t,
            "data",
            "prepare",
            "--data",
            "{S}/text.txt",
            "--out",
            "{S}/shards",
            "--tokenizer",
            "{S}/bad-tokenizer.json",
        ),
        _c(t, "data", "instructions", "--out", "{S}/ins.jsonl", "--max-examples", "lots"),
        _c(
            t,
            "tokenizer",
            "train",
            "--data",
            "{S}/bad.jsonl",
            "--out",
            "{S}/tok.json",
            "--vocab-size",
            "300",
        ),
        _c(
            t,
            "tokenizer",
            "train",
            "--data",
            "{S}/text.txt",
            "--out",
            "{S}/tok.json",
            "--vocab-size",
            "many",
        ),
        _c(t, "generate", "--init-from", "{S}/bad-hf", "--prompt", "x"),
        _c(t, "train", *FROM_HF, "--out", "{S}/new-run", "--init-from", "{S}/bad-hf"),
        _c(t, "eval", "--checkpoint", "{S}/run", "--data", "{S}/bad.jsonl", "--format", "alpaca"),
        _c(t, "eval", "--init-from", "{S}/bad-hf", "--data", "{S}/text.txt"),
    ]
    return cases


def conflicting_flags() -> list[Case]:
    f = "conflicting flags"
    cases = [_train(f, *flags) for flags in (
        ["--dp", "2", "--global-batch", "3"], ["--micro-batch", "4", "--global-batch", "2"],
        ["--pp", "2", "--schedule", "2bw", "--nan-policy", "skip"],
        ["--pp", "4", "--n-layers", "2"], ["--tp", "3"], ["--zero", "3", "--dp-mode", "naive"],
        ["--offload", "nvme"], ["--sequence-parallel"], ["--schedule", "interleaved"],
        ["--pp", "2", "--stage-layers", "1,1,1"], ["--min-lr", "1", "--lr", "0.1"],
        ["--precision", "fp16", "--reduce-dtype", "bf16"], ["--resume", "{S}/run"],
        ["--tp", "2", "--n-heads", "3"], ["--virtual-stages", "2"],
        ["--model", "tiny-llama", "--resume", "{S}/run"])]  # fmt: skip
    cases += [
        _c(f, "train", *TINY, "--out", "{S}/run"),  # a run already there
        _c(
            f,
            "train",
            *TINY,
            "--out",
            "{S}/new-run",
            "--init-from",
            "{S}/hf-ok",
            "--model",
            "tiny-llama",
        ),
        _c(
            f,
            "plan",
            "--gpus",
            "64",
            "--gpus-per-node",
            "7",
            "--global-batch",
            "8",
            "--seq-len",
            "64",
        ),
        _c(f, "plan", "--gpus", "8", "--tp", "16", "--global-batch", "8", "--seq-len", "64"),
        _c(f, "plan", "--gpus", "8", "--dp", "3", "--global-batch", "8", "--seq-len", "64"),
        _c(f, "estimate", "--model", "tiny-gpt", "--global-batch", "3", "--dp", "2"),
        _c(f, "estimate", "--model", "tiny-gpt", "--tp", "2", "--n-heads", "3"),
        _c(f, "generate", "--prompt", "x"),  # neither --checkpoint nor --init-from
        _c(f, "generate", "--checkpoint", "{S}/run", "--init-from", "{S}/hf-ok", "--prompt", "x"),
        _c(f, "checkpoint", "consolidate", "{S}/run", "--out", "{S}/exists.safetensors"),
        _c(f, "data", "prepare", "--data", "{S}/text.txt", "--out", "{S}/folder"),
        _c(f, "data", "instructions", "--out", "{S}/exists.txt"),
        _c(
            f,
            "eval",
            "--checkpoint",
            "{S}/run",
            "--init-from",
            "{S}/hf-ok",
            "--data",
            "{S}/text.txt",
        ),
        _c(f, "eval", "--checkpoint", "{S}/run", "--data", "{S}/text.txt", "--model", "tiny-llama"),
        _c(f, "export", "--checkpoint", "{S}/run", "--out", "{S}/bad-lessons"),
        _c(
            f,
            "schedule",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--schedule",
            "2bw",
            "--virtual-stages",
            "2",
        ),
    ]
    return cases


DAMAGES = ("no-commit", "no-manifest", "bad-manifest", "cut-file", "flipped-byte", "no-trainer",
           "bad-trainer", "empty", "run-without-checkpoint")  # fmt: skip
"""Copies of a real checkpoint, each damaged one way (`_damage`)."""


def damaged_checkpoints() -> list[Case]:
    d = "damaged checkpoint"
    cases = []
    for damage in DAMAGES:
        path = "{S}/damaged/" + damage
        cases += [_c(d, "checkpoint", "info", path),
                  _c(d, "checkpoint", "consolidate", path, "--out", "{S}/c.safetensors"),
                  _c(d, "export", "--checkpoint", path, "--out", "{S}/hf"),
                  _c(d, "generate", "--checkpoint", path, "--prompt", "x"),
                  _c(d, "train", *TINY, "--out", "{S}/new-run", "--resume", path),
                  _c(d, "eval", "--checkpoint", path, "--data", "{S}/text.txt")]  # fmt: skip
    return cases


COMMANDS = (["train", "--out", "{S}/r"], ["estimate"], ["plan", "--gpus", "8"], ["calibrate"],
            ["schedule", "--pp", "2"], ["presets"], ["checkpoint", "info", "x"],
            ["checkpoint", "consolidate", "x", "--out", "y"], ["export"], ["generate"],
            ["data", "prepare", "--out", "y"], ["data", "instructions", "--out", "y"],
            ["tokenizer", "train", "--out", "y"], ["lessons"], ["eval"])  # fmt: skip


def signals() -> list[Case]:
    return [_c("signals", *argv, code=128 + s) for argv in COMMANDS
            for s in (signal.SIGINT, signal.SIGTERM)]  # fmt: skip


def all_cases() -> list[Case]:
    return (wrong_values() + wrong_paths() + wrong_types() + conflicting_flags()
            + damaged_checkpoints() + signals())  # fmt: skip


# --- the scratch folder ---------------------------------------------------------------


def scratch(root: Path, trained: bool = True) -> Path:
    """Everything the cases name under {S}: text, a binary file, bad TOML, a folder, an
    unreadable lessons.json, a tiny Hugging Face folder, and (`trained`) a real run with a
    checkpoint and its damaged copies."""
    root.mkdir(parents=True, exist_ok=True)
    text = "".join(f"def f{i}(x):\n    return x * {i}  # line {i}\n" for i in range(3000))
    (root / "text.txt").write_text(text)
    (root / "exists.txt").write_text("keep me\n")
    (root / "exists.safetensors").write_bytes(b"\0" * 16)
    (root / "binary.toml").write_bytes(bytes(range(256)) * 4)
    (root / "bad.toml").write_text("[train\nsteps = \n")
    (root / "wrong-type.toml").write_text('[train]\nlr = "fast"\n')
    (root / "unknown-key.toml").write_text("[train]\nstepz = 3\n")
    (root / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    (root / "bad-tokenizer.json").write_text("{not a tokenizer")
    for name in ("folder", "empty", "bad-lessons", "bad-hf"):
        (root / name).mkdir(exist_ok=True)
    (root / "bad-lessons" / "lessons.json").write_text("{half")
    (root / "bad-hf" / "config.json").write_text('{"model_type": "bert"}')
    if trained:
        _train_tiny(root)
    return root


def _train_tiny(root: Path) -> None:
    """A one-step run at {S}/run (in this process: one rank, nothing spawned), its copies
    damaged one way each under {S}/damaged, and its export at {S}/hf-ok."""
    from plait.checkpoint.store import latest
    from plait.cli import main

    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", *TINY, "--steps", "1", "--data", str(root / "text.txt"),
                     "--out", str(root / "run")])  # fmt: skip
        assert code == 0, "the sweep's tiny run failed"
        ckpt = latest(root / "run")
        assert main(["export", "--checkpoint", str(ckpt), "--out", str(root / "hf-ok")]) == 0
    for damage in DAMAGES:
        _damage(ckpt, root / "damaged" / damage, damage)


def _damage(ckpt: Path, to: Path, how: str) -> None:
    if how == "run-without-checkpoint":
        (to / "checkpoints").mkdir(parents=True)
        (to / "summary.json").write_text("{}")
        return
    if how == "empty":
        to.mkdir(parents=True)
        return
    shutil.copytree(ckpt, to)
    data = sorted(p for p in to.rglob("*.distcp"))
    if how == "no-commit":
        (to / "COMMITTED").unlink()
    elif how == "no-manifest":
        (to / "manifest.json").unlink()
    elif how == "bad-manifest":
        (to / "manifest.json").write_text("{cut")
    elif how == "cut-file":
        data[0].write_bytes(data[0].read_bytes()[:100])
    elif how == "flipped-byte":
        raw = bytearray(data[0].read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data[0].write_bytes(bytes(raw))
    elif how == "no-trainer":
        (to / "trainer.json").unlink()
    elif how == "bad-trainer":
        (to / "trainer.json").write_text('{"step": ')


# --- running a case ------------------------------------------------------------------


class ReachedWorkers(Exception):
    """Raised where a command would start its workers: the input got past every check."""


@contextlib.contextmanager
def no_workers():
    """Every place a command starts workers or its long work raises `ReachedWorkers`."""

    def reached(*args, **kwargs):
        raise ReachedWorkers()

    targets = ["plait.cli.train.launch", "torch.multiprocessing.start_processes",
               "plait.lessons.runner.launch", "plait.cli.evaluate.launch",
               "plait.data.prepare._pool",
               "plait.data.tokenizer.stoppable"]  # fmt: skip
    with contextlib.ExitStack() as stack:
        for target in targets:
            stack.enter_context(mock.patch(target, reached))
        yield


@dataclass
class Result:
    case: Case
    code: int | None
    err: str
    reached: bool = False
    left: tuple[str, ...] = ()

    @property
    def lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]

    @property
    def ok(self) -> bool:
        return (self.code == self.case.code and len(self.lines) == 1 and not self.reached
                and "Traceback" not in self.err and not self.left)  # fmt: skip

    def why(self) -> str:
        if self.reached:
            return "reached the workers"
        if self.left:
            return f"left {', '.join(self.left)}"
        if self.code != self.case.code:
            return f"exit {self.code}, not {self.case.code}"
        if "Traceback" in self.err:
            return "traceback"
        return f"{len(self.lines)} lines"


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def run_in_process(case: Case, root: Path) -> Result:
    from plait.cli import main

    argv = [a.replace("{S}", str(root)) for a in case.argv]
    before, err = _files(root), io.StringIO()
    code, reached = None, False
    cwd = os.getcwd()
    os.chdir(root)  # a default output (runs/default, lessons) lands in the scratch folder
    try:
        with (
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
            no_workers(),
        ):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse
                code = e.code if isinstance(e.code, int) else 1
            except ReachedWorkers:
                reached = True
            except Exception:  # a traceback the user would see
                err.write(traceback.format_exc())
                code = 1
    finally:
        os.chdir(cwd)
    left = tuple(sorted(_files(root) - before))
    for name in left:  # the next case starts from the same folder
        path = root / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return Result(case, code, err.getvalue(), reached, left)


def run_signal(case: Case, root: Path) -> Result:
    """`plait ARGV` as a process, paused at its start, sent the case's signal there."""
    signum = case.code - 128
    argv = [a.replace("{S}", str(root)) for a in case.argv]
    pause = Path(tempfile.mkdtemp(prefix="sweep-pause-"))
    env = {**os.environ, "PLAIT_PAUSE_AT": f"start:{pause}"}
    proc = subprocess.Popen([sys.executable, "-m", "plait.cli", *argv], env=env, cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (pause / "start.plait").exists() and proc.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        shutil.rmtree(pause, ignore_errors=True)
    return Result(case, proc.returncode, err)


def run(cases: list[Case], root: Path) -> list[Result]:
    return [run_signal(c, root) if c.cls == "signals" else run_in_process(c, root) for c in cases]


def counts(results: list[Result]) -> dict[str, tuple[int, int]]:
    """(cases, ok) per class, in CLASSES order."""
    total, ok = Counter(r.case.cls for r in results), Counter(r.case.cls for r in results if r.ok)
    return {cls: (total[cls], ok[cls]) for cls in CLASSES if total[cls]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=CLASSES, help="run one class")
    parser.add_argument("--list", action="store_true", help="print the cases, run none")
    parser.add_argument("--verbose", action="store_true", help="print each case's line")
    args = parser.parse_args(argv)
    cases = [c for c in all_cases() if args.only in (None, c.cls)]
    if args.list:
        for c in cases:
            print(f"{c.cls:20} {c.code}  plait {' '.join(c.argv)}")
        return 0
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plait-sweep-") as tmp:
        root = scratch(Path(tmp) / "S", trained=args.only != "signals")
        results = run(cases, root)
    commands = sorted({r.case.command for r in results})
    print(f"{len(results)} wrong inputs over {len(commands)} commands "
          f"in {time.perf_counter() - began:.0f} s")  # fmt: skip
    print(f"{'class':20} {'cases':>6} {'one line + expected exit, nothing left':>40}")
    for cls, (n, ok) in counts(results).items():
        print(f"{cls:20} {n:6} {ok:40}")
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"\nNOT OK ({r.why()}): plait {' '.join(r.case.argv)}")
        print("  " + "\n  ".join(r.err.strip().splitlines()[-6:]))
    if args.verbose:
        for r in results:
            print(f"{r.case.code} {r.code} {r.case.command:24} {r.lines[-1] if r.lines else ''}")
    print(json.dumps({"cases": len(results), "ok": len(results) - len(failed)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
