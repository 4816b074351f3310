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
prepare, tokenizer training) are tests/test_signal_phases.py. The table of cases is
bad_input_cases.py; tests/test_bad_input_sweep.py runs a slice of it. The counts last seen
are in docs/running.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from bad_input_cases import CLASSES, DAMAGES, TINY, Case, core_cases
from bad_input_families import family_cases
from bad_input_families import folders as family_folders

__all__ = ["CLASSES", "TINY", "Case", "all_cases", "main", "run", "scratch"]


def all_cases() -> list[Case]:
    """The whole table: every command's cases, then the model families'."""
    return core_cases() + family_cases()


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
    (root / "wrong-type.toml").write_text('[optim]\nlr = "fast"\n')
    (root / "unknown-key.toml").write_text("[train]\nstepz = 3\n")
    (root / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    (root / "bad-tokenizer.json").write_text("{not a tokenizer")
    for name in ("folder", "empty", "bad-lessons", "bad-hf"):
        (root / name).mkdir(exist_ok=True)
    (root / "bad-lessons" / "lessons.json").write_text("{half")
    (root / "bad-hf" / "config.json").write_text('{"model_type": "bert"}')
    _instruction_files(root)
    if trained:
        _train_tiny(root)
    return root


def _word_tokenizer(folder: Path, words: list[str], template: str | None = None) -> None:
    """A small word-level tokenizer folder with an EOS (and a chat template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "</s>"} | ({"chat_template": template} if template else {})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _instruction_files(root: Path) -> None:
    """A tokenizer with a chat template ({S}/tok), instruction files json.load refuses, one
    object over lines, a chat with an unknown role, and good rows ({S}/rows.json)."""
    _word_tokenizer(root / "tok", ["a", "b"], "{% for m in messages %}{{ m.content }}{% endfor %}")
    row = json.dumps({"instruction": "a", "input": "", "output": "b"})
    broken = {"trailing-comma": f"[{row},\n{row},\n]", "extra-comma": f"[{row},,\n{row}]",
              "missing-comma": f"[{row}\n{row}]", "junk-after": f"[{row}]\nx",
              "two-arrays": f"[{row}]\n[{row}]\n", "one-object": row.replace(", ", ",\n"),
              "rows": f"[{row},\n{row},\n{row}]"}  # fmt: skip
    for name, text in broken.items():
        (root / f"{name}.json").write_text(text)
    chat = [{"role": "bot", "content": "a"}, {"role": "assistant", "content": "b"}]
    (root / "bad-role.jsonl").write_text(json.dumps({"messages": chat}) + "\n")


def _models_of_other_kinds(root: Path) -> None:
    """Copies of {S}/hf-ok: quantized by its config.json ({S}/hf-nf4), and with a tokenizer
    of its own ({S}/hf-tok); and shards of bytes ({S}/shards-bytes)."""
    from plait.data.prepare import PrepareJob, prepare

    shutil.copytree(root / "hf-ok", root / "hf-nf4")
    config = json.loads((root / "hf-ok" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                     "bnb_4bit_quant_type": "nf4"}  # fmt: skip
    (root / "hf-nf4" / "config.json").write_text(json.dumps(config))
    shutil.copytree(root / "hf-ok", root / "hf-tok")
    _word_tokenizer(root / "hf-tok", ["x", "y", "z"])
    prepare(PrepareJob(str(root / "text.txt"), root / "shards-bytes"))


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
    _models_of_other_kinds(root)
    family_folders(root)
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
