"""Ctrl-C (SIGINT to the whole process group) and SIGTERM (to plait alone) at every phase of
every command that runs for long: one line, exit 130 or 143, no traceback, no process left,
nothing half-written.

Each command runs as a process of its own with PLAIT_PAUSE_AT naming the phase: the process
that reaches it writes a marker and waits there; the test signals it then, never after a
fixed time. A run that must go on after the signal also pauses at the launcher's
'forwarded' phase (the launcher has passed the signal on to its workers), and the test lets
both phases go only once that marker is there.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from in_process import TINY
from phases import ended, pause_env, processes_with, release, start_plait, wait_for_phase
from plait.checkpoint import store

INT, TERM = signal.SIGINT, signal.SIGTERM
AT_ONCE = "plait: stopped at once; every rank ended, no checkpoint."


def _send(proc, signum: int) -> None:
    """Ctrl-C reaches the whole group; SIGTERM is sent to plait alone (`kill PID`)."""
    if signum == INT:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)


def _checkpoints(out: Path) -> dict[str, bool]:
    """Each step folder under `out/checkpoints`: whether it is committed (and then whole)."""
    found = {}
    for folder in sorted((out / "checkpoints").glob("step-*")):
        found[folder.name] = store.committed(folder)
        if found[folder.name]:
            store.verify(folder)
    return found


def _clean(err: str, marker: str, code: int, signum: int) -> None:
    assert code == 128 + signum, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert processes_with(marker) == []  # no orphan


# phase paused, the processes that reach it, the signal, whether the run goes on after it,
# the line it ends with, and the checkpoints left ({} for none; committed or not)
TRAIN = {
    "spawn": ("spawn", ["launcher"], INT, True, AT_ONCE, {}),
    "rendezvous": ("rendezvous", ["rank0", "rank1"], TERM, False, AT_ONCE, {}),
    "evaluate": ("evaluate", ["rank0", "rank1"], INT, True,
                 "plait: stopped by SIGINT after step 3; checkpoint {out}/checkpoints/step-3; "
                 "continue with --resume latest --out {out}", {"step-2": True, "step-3": True}),
    "save": ("save", ["rank0", "rank1"], TERM, True,
             "plait: stopped by SIGTERM after step 3; checkpoint {out}/checkpoints/step-3",
             {"step-2": True, "step-3": True}),
    "sample": ("sample", ["rank0"], INT, True,
               "plait: SIGINT came after the last step; the run is whole",
               {"step-2": True, "step-4": True}),
}  # fmt: skip


@pytest.mark.parametrize("case", TRAIN, ids=list(TRAIN))
def test_train_stops_cleanly_at_each_phase(case, tmp_path):
    """One signal at a phase of `plait train` (dp2, 4 steps, a checkpoint every 2): before the
    run can stop after a step (spawn, rendezvous) every rank ends at once, with no
    checkpoint; during step 2's evaluation or save the ranks agree to stop after the next
    step (`Comm.agreed_stop`) and commit its checkpoint; during the summary's sample the run
    is already whole and says so."""
    phase, who, signum, goes_on, line, left = TRAIN[case]
    marker, pause, out = f"PLAIT_TEST_MARK_{uuid.uuid4().hex}", tmp_path / "pause", tmp_path / "run"
    pause.mkdir()
    phases = f"{phase},forwarded" if goes_on else phase
    argv = ["train", *TINY, "--save-every", "2", "--out", str(out)]
    proc = start_plait(argv, marker, pause_env(phases, pause))
    wait_for_phase(pause, phase, who, proc)
    _send(proc, signum)
    if goes_on:
        wait_for_phase(pause, "forwarded", ["launcher"], proc)
        release(pause, phase)
        release(pause, "forwarded")
    err = ended(proc)
    _clean(err, marker, proc.returncode, signum)
    assert line.format(out=out) in err
    if phase in ("evaluate", "save"):  # the summary names the signal, also one sent to the
        name = signal.Signals(signum).name  # launcher alone (the workers get its forward)
        assert f"3 of 4 (stopped by {name})" in err
    assert _checkpoints(out) == left
    if phase == "sample":
        assert json.loads((out / "summary.json").read_text())["steps_done"] == 4


@pytest.mark.parametrize("phase", ["save", "sample"])
def test_a_second_ctrl_c_names_what_is_on_disk(phase, tmp_path):
    """Ctrl-C twice: during a save (written, not committed) the run ends at once and nothing
    of it is taken for a checkpoint; after the last save (the summary's sample) the run
    ends at once too, and the line names the checkpoint committed before, not 'none'."""
    marker, pause, out = f"PLAIT_TEST_MARK_{uuid.uuid4().hex}", tmp_path / "pause", tmp_path / "run"
    pause.mkdir()
    argv = ["train", *TINY, "--save-every", "2", "--out", str(out)]
    proc = start_plait(argv, marker, pause_env(f"{phase},forwarded", pause))
    wait_for_phase(pause, phase, ["rank0"], proc)
    _send(proc, INT)
    wait_for_phase(pause, "forwarded", ["launcher"], proc)
    _send(proc, INT)
    err = ended(proc)
    _clean(err, marker, proc.returncode, INT)
    if phase == "save":
        assert AT_ONCE in err
        assert _checkpoints(out) == {"step-2": False}  # never loaded: --resume skips it
    else:
        kept = f"{out}/checkpoints/step-4"
        assert f"every rank ended, newest checkpoint {kept}; continue with --resume" in err
        assert _checkpoints(out) == {"step-2": True, "step-4": True}


def test_sigterm_stops_calibrate_and_every_rank(tmp_path):
    """SIGTERM to calibrate alone, its workers measuring: it stops them all (no orphan
    keeps measuring), one line, 143, nothing written (Ctrl-C: test_plan_step_terms)."""
    marker, out = f"PLAIT_TEST_MARK_{uuid.uuid4().hex}", tmp_path / "hw.toml"
    argv = ["calibrate", "--ranks", "2", "--out", str(out)]
    proc = start_plait(argv, marker, pause_env("calibrate", tmp_path))
    wait_for_phase(tmp_path, "calibrate", ["rank0", "rank1"], proc)
    _send(proc, TERM)
    err = ended(proc)
    _clean(err, marker, proc.returncode, TERM)
    assert f"plait: calibrate interrupted; every rank stopped, {out} not written" in err
    assert not out.exists()


def test_ctrl_c_stops_a_lesson_case_and_writes_nothing(tmp_path):
    """Ctrl-C while a lesson's case runs (its world paused as it joins): every rank ends, one
    line, 130, and the output folder gets no report of the lessons not finished."""
    marker, pause, out = f"PLAIT_TEST_MARK_{uuid.uuid4().hex}", tmp_path / "pause", tmp_path / "l"
    pause.mkdir()
    argv = ["lessons", "--quick", "--only", "dp", "--out", str(out)]
    proc = start_plait(argv, marker, pause_env("rendezvous", pause))
    wait_for_phase(pause, "rendezvous", ["rank0", "rank1"], proc)
    _send(proc, INT)
    err = ended(proc)
    _clean(err, marker, proc.returncode, INT)
    assert "plait: lessons interrupted; every rank stopped." in err
    assert not (out / "lessons.md").exists() and not (out / "lessons.json").exists()


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """17 MB of text: three 8 MiB pieces, so that workers still tokenize after the first."""
    folder = tmp_path_factory.mktemp("text")
    line = "the quick brown fox jumps over the lazy dog; " * 20 + "\n"
    (folder / "a.txt").write_text(line * (17_000_000 // len(line)))
    return folder


@pytest.mark.parametrize("signum", [INT, TERM], ids=["ctrl-c", "term"])
@pytest.mark.parametrize("command", ["prepare", "tokenizer"])
def test_data_commands_stop_cleanly(command, signum, text, tmp_path):
    """`data prepare` (its pool of workers tokenizing, shards half written) and `tokenizer
    train` (training on the texts it reads), stopped: one line, 130 or 143, no worker left,
    and neither the output nor OUT.partial nor a temporary file beside it."""
    marker, pause, out = f"PLAIT_TEST_MARK_{uuid.uuid4().hex}", tmp_path / "pause", tmp_path / "o"
    pause.mkdir()
    if command == "prepare":
        argv = ["data", "prepare", "--data", str(text), "--workers", "2", "--no-progress"]
    else:
        argv = ["tokenizer", "train", "--data", str(text), "--vocab-size", "300", "--no-progress"]
    proc = start_plait([*argv, "--out", str(out)], marker, pause_env(command, pause))
    wait_for_phase(pause, command, ["plait"], proc)
    _send(proc, signum)
    release(pause, command)  # the tokenizer reads on in a thread of its own, then stops
    err = ended(proc)
    _clean(err, marker, proc.returncode, signum)
    what = "interrupted" if signum == INT else "stopped by SIGTERM"
    assert err.strip().splitlines()[-1] == f"plait: {what}; nothing more runs.", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pause"]  # no o, o.partial, .o.tmp


START = {"launch": ("prepare-launch", "plait", TERM), "worker": ("prepare-worker", "worker", INT)}
"""`data prepare` paused while a worker starts: inside the parent's start of one (the
forkserver asked for it; a signal there used to leave a worker whose task never came, which
printed a 14-line EOFError traceback after plait's line), and in a worker's own first code."""


@pytest.mark.parametrize("case", START, ids=list(START))
def test_prepare_stops_at_once_while_its_workers_start(case, text, tmp_path):
    """One line, 130 or 143, nothing left, no traceback at any moment; the line comes within
    seconds of the signal (the workers are killed, not waited for: that took up to 55 s)."""
    phase, who, signum = START[case]
    marker, pause, out = f"PLAIT_TEST_MARK_{uuid.uuid4().hex}", tmp_path / "pause", tmp_path / "o"
    pause.mkdir()
    argv = ["data", "prepare", "--data", str(text), "--workers", "2", "--no-progress"]
    proc = start_plait([*argv, "--out", str(out)], marker, pause_env(phase, pause))
    wait_for_phase(pause, phase, [who], proc)
    _send(proc, signum)
    sent = time.monotonic()
    release(pause, phase)
    line = proc.stderr.readline()  # printed before the interpreter's own exit
    took = time.monotonic() - sent
    err = line + ended(proc)
    _clean(err, marker, proc.returncode, signum)
    what = "interrupted" if signum == INT else "stopped by SIGTERM"
    assert err.strip().splitlines() == [f"plait: {what}; nothing more runs."], err
    assert took < 10, f"{took:.1f} s from the signal to plait's line"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pause"]
