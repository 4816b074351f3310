"""End to end through the real command and launcher: local spawn, torchrun, signals, and
failure on one rank.

The launcher is what these tests test, so each runs `plait train` as a process of its own
and one run is checked for every property it shows. What follows a launched run and does
not depend on the launcher (a resumed run continuing the losses) runs in process on a
harness world (tests/in_process.py); so do the tests of what a run writes
(test_train_command.py). A signal is sent at a phase the test observes (a metrics row
written, the launcher's marker that it passed a first signal on), never after a fixed time.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch.multiprocessing as mp

import in_process
from in_process import TINY
from phases import pause_env, processes_with, release, wait_for_phase
from plait.checkpoint import store
from plait.cli import main
from plait.launch import _first_failure, _say_restart
from plait.slurm import PORT_BASE, PORT_SPAN


def _plait(args: list[str], env: dict | None = None, launcher: list[str] | None = None):
    cmd = (launcher or [sys.executable, "-m", "plait.cli"]) + ["train", *TINY, *args]
    full_env = {**os.environ, **(env or {})}
    # A session of its own, so a hung run is killed with all its workers, not just the parent.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after 120 s; stderr:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
PLAIN_STEPS = 64  # steps are tens of ms: a signal sent after the first lands within these
CONSTANT_LR = ["--lr", "1e-3", "--min-lr", "1e-3", "--warmup-steps", "0"]  # any --steps alike


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The run the others are compared with: dp2, 64 steps of a constant learning rate (so its
    first k losses are those of a k-step run), never stopped."""
    out = tmp_path_factory.mktemp("plain")
    return _plait(["--out", str(out), "--steps", str(PLAIN_STEPS), *CONSTANT_LR]), out


def test_train_dp2_writes_metrics_and_summary(plain):
    proc, out = plain
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(PLAIN_STEPS))
    assert all({"loss", "lr", "grad_norm", "tokens_per_s", "comm_bytes"} <= r.keys() for r in rows)
    assert rows[0]["comm_bytes"]["all_reduce"] > 0
    assert "val_loss" in rows[1] and "val_loss" in rows[3] and "val_loss" not in rows[2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layout"].startswith("dp=2")
    assert "unigram baseline" in proc.stderr


def test_failure_on_one_rank_stops_all_and_its_unfinished_save_is_skipped(world2, tmp_path):
    """Rank 1 dies while the step-4 checkpoint is written: every rank stops, the launcher
    exits 1 with rank 1's traceback, no worker and no temporary file is left; what rank 0
    wrote before the failure is on disk, line by line. The step-4 folder is never committed,
    and --resume latest continues from step 2 with a warning."""
    marker = f"PLAIT_TEST_MARK_{uuid.uuid4().hex}"
    temp = tmp_path / "temp"  # the run's temporary folder: nothing may be left in it
    temp.mkdir()
    out = tmp_path / "cut"
    env = {"PLAIT_FAULT": "1:save-4", marker: "1", "TMPDIR": str(temp)}
    proc = _plait(["--out", str(out), "--save-every", "2"], env=env)
    assert proc.returncode == 1
    assert "a worker failed; all ranks stopped" in proc.stderr
    assert "rank 1 failed first" in proc.stderr
    assert "injected fault (PLAIT_FAULT=1:save-4) on rank 1 at step save-4" in proc.stderr
    assert "Traceback" in proc.stderr
    assert "Terminating process" not in proc.stderr  # torch's lines about ranks plait ends
    assert processes_with(marker) == []  # no orphan worker left behind
    left = [p.name for p in temp.iterdir() if p.name != "torchinductor_root"]  # torch's cache
    assert left == []  # no pytorch-errorfile-*, no plait-errors-* folder
    assert not (out / "checkpoints" / "step-4" / "COMMITTED").exists()
    before = _losses(out)
    assert len(before) == 3  # steps 0-2, written line by line; step 3's waits for its save
    code, err = in_process.train(world2, [*TINY, "--out", str(out), "--resume", "latest",
                                          "--steps", "6"])  # fmt: skip
    assert code == 0, err
    assert "step-4: the save did not finish" in err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert _losses(out)[:2] == before[:2]  # the rows before the checkpoint are kept


def _start(
    args: list[str], marker: str, launcher: list[str] | None = None, env: dict | None = None
) -> subprocess.Popen:
    cmd = (launcher or [sys.executable, "-m", "plait.cli"]) + ["train", *TINY, *CONSTANT_LR]
    cmd += args
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, marker: "1", **(env or {})}, start_new_session=True,
    )  # fmt: skip


def _signal_after_rows(proc: subprocess.Popen, metrics: Path, send) -> str:
    """Wait for a metrics row, call `send`, return stderr once the run has ended."""
    try:
        deadline = time.monotonic() + 90
        while not (metrics.exists() and metrics.read_text().splitlines()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        send()
        return proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_signal_ends_the_step_saves_and_exits(plain, world2, tmp_path):
    """Ctrl-C (SIGINT to the whole group) at any step: every rank finishes its step, a
    checkpoint is written, one line says where, the exit code is 130; no worker is left,
    every metrics line is whole, and the run resumes from there (in process) with the losses
    of a run never stopped. SIGTERM to the launcher alone, at a phase, with the same lines
    and checkpoint: test_signal_phases (`save`)."""
    signum = signal.SIGINT
    marker = f"PLAIT_TEST_MARK_{uuid.uuid4().hex}"
    run = tmp_path / "run"
    proc = _start(["--steps", "100000", "--out", str(run)], marker)
    err = _signal_after_rows(proc, run / "metrics.jsonl", lambda: os.killpg(proc.pid, signum))
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err
    assert processes_with(marker) == []
    done = len(_losses(run))
    assert done < PLAIN_STEPS
    name = signal.Signals(signum).name
    assert f"plait: stopped by {name} after step {done}; checkpoint " in err
    assert f"; continue with --resume latest --out {run}\n" in err
    assert f"{done} of 100000 (stopped by {name})" in err  # the summary: the steps done
    assert (run / "checkpoints" / f"step-{done}" / "COMMITTED").exists()
    steps = ["--steps", str(done + 1), *CONSTANT_LR]
    code, resumed = in_process.train(world2, [*TINY, "--out", str(run), "--resume", "latest",
                                              *steps])  # fmt: skip
    assert code == 0, resumed
    assert len(_losses(run)) == done + 1
    assert _losses(run) == _losses(plain[1])[: done + 1]  # bitwise: same layout


def test_a_second_signal_stops_at_once(tmp_path):
    """SIGTERM twice to the launcher: no waiting for the step or the save; every worker ends,
    no traceback, and no checkpoint of that moment is ever taken for a finished one. The
    second is sent once the launcher has passed the first on (it pauses there for the
    test): two signals sent too close together arrive as one."""
    marker = f"PLAIT_TEST_MARK_{uuid.uuid4().hex}"
    pause = tmp_path / "pause"
    pause.mkdir()
    env = pause_env("forwarded", pause)
    proc = _start(["--steps", "100000", "--out", str(tmp_path)], marker, env=env)

    def twice() -> None:
        proc.send_signal(signal.SIGTERM)
        wait_for_phase(pause, "forwarded", ["launcher"], proc)
        proc.send_signal(signal.SIGTERM)
        release(pause, "forwarded")

    err = _signal_after_rows(proc, tmp_path / "metrics.jsonl", twice)
    assert proc.returncode == 143, err
    kept = store.latest(tmp_path, warn=False)  # the step's save may have committed first
    ended = f"newest checkpoint {kept}; continue with --resume latest" if kept else "no checkpoint."
    assert f"plait: stopped at once; every rank ended, {ended}" in err
    assert "Traceback" not in err
    assert processes_with(marker) == []
    _losses(tmp_path)  # every metrics line whole
    for folder in (tmp_path / "checkpoints").glob("step-*"):  # any committed one is whole
        if store.committed(folder):
            store.verify(folder)


def test_sigterm_to_torchrun_reaches_the_workers(tmp_path):
    """torchrun passes a SIGTERM on to its workers: they finish the step and save, as under
    plait's launcher; torchrun then reports the signal its own way (exit code 1)."""
    marker = f"PLAIT_TEST_MARK_{uuid.uuid4().hex}"
    torchrun = [*TORCHRUN, "--nproc-per-node", "2", "-m", "plait.cli"]
    proc = _start(["--steps", "100000", "--out", str(tmp_path)], marker, torchrun)
    err = _signal_after_rows(proc, tmp_path / "metrics.jsonl", lambda: proc.send_signal(15))
    assert proc.returncode != 0
    done = len(_losses(tmp_path))
    assert f"plait: stopped by SIGTERM after step {done}; checkpoint " in err
    store.verify(store.complete(tmp_path / "checkpoints" / f"step-{done}"))
    assert processes_with(marker) == []


@pytest.mark.parametrize("launcher", ["plait", "torchrun"])
def test_a_killed_rank_restarts_from_the_newest_checkpoint(launcher, plain, tmp_path):
    """Rank 1 dies at step 3 after the step-2 checkpoint; with --max-restarts 1 the world
    starts again from it and ends with the uninterrupted run's losses and summary. Under
    torchrun, torchrun restarts the workers and `--resume latest` finds the checkpoint."""
    out = tmp_path / "restarted"
    args = ["--out", str(out), "--save-every", "2", "--resume", "latest", *CONSTANT_LR]
    if launcher == "plait":
        proc = _plait([*args, "--max-restarts", "1"], env={"PLAIT_FAULT": "1:3"})
        assert "plait: rank 1 failed (RuntimeError: injected fault" in proc.stderr
        assert f"restart 1/1 from {out}/checkpoints/step-2" in proc.stderr
    else:
        torchrun = [*TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "1", "-m", "plait.cli"]
        proc = _plait(args, env={"PLAIT_FAULT": "1:3"}, launcher=torchrun)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _losses(out) == _losses(plain[1])[:4]  # bitwise: same layout
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["restarts"], summary["world_size"]) == (1, 2)


def test_quiet_termination_drops_only_torchs_terminating_lines(caplog) -> None:
    """While plait waits on its workers, torch's "Terminating process N via signal SIGTERM"
    lines (one per worker it ends after another failed) are dropped; other warnings show,
    and outside the wait the message shows again."""
    from plait.launch import quiet_termination

    log = logging.getLogger("torch.multiprocessing.spawn")
    with caplog.at_level(logging.WARNING), quiet_termination():
        log.warning("Terminating process %s via signal SIGTERM", 1234)
        log.warning("something else %s", 1)
    assert [r.getMessage() for r in caplog.records] == ["something else 1"]
    with caplog.at_level(logging.WARNING):
        log.warning("Terminating process %s via signal SIGTERM", 1234)
    assert caplog.records[-1].getMessage() == "Terminating process 1234 via signal SIGTERM"


def test_a_killed_rank_is_named_not_the_peer_that_lost_it(tmp_path, capsys):
    """A rank killed outright writes no record; its peer's closed-connection error does. The
    killed rank is the one named, by the failure a stopped run reports and by the restart
    line alike (both read `_first_failure`); a rank that raised first is still named."""
    peer = {"rank": 0, "time": 1.0, "traceback": "CommError: Connection closed by peer\n"}
    (tmp_path / "rank0.json").write_text(json.dumps({**peer, "line": None}))
    killed = mp.ProcessExitedException(
        "process 1 terminated with signal SIGKILL", error_index=1, error_pid=1, exit_code=-9,
        signal_name="SIGKILL",
    )  # fmt: skip
    failure = _first_failure(str(tmp_path), killed)
    assert (failure.rank, failure.others) == (1, [0])
    assert str(failure).startswith("rank 1 failed first (then ranks [0] failed too):")
    _say_restart(failure, 1, 2, tmp_path)
    err = capsys.readouterr().err
    assert "plait: rank 1 failed (process 1 terminated with signal SIGKILL); restart 1/2" in err
    raised = mp.ProcessRaisedException("CommError", error_index=0, error_pid=1)
    assert _first_failure(str(tmp_path), raised).rank == 0


def _free_job_id() -> str:
    """A Slurm job id whose derived port (`plait.slurm.job_port`) is free here now."""
    for job in random.Random().sample(range(PORT_SPAN), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", PORT_BASE + job))
            except OSError:
                continue
            return str(job)
    raise AssertionError("no free port in plait's Slurm range")


def _srun_env(rank: int, job: str) -> dict[str, str]:
    """What srun gives task `rank` of 2 on one node; torchrun's variables left out."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}  # fmt: skip
    env.update(SLURM_NTASKS="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
               SLURM_NODEID="0", SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="127.0.0.1",
               SLURM_JOB_ID=job, SLURM_JOB_NAME="plait")  # fmt: skip
    return env


def test_srun_tasks_equal_local_dp2_and_resume_elastically(plain, tmp_path, monkeypatch):
    """Two processes given srun's variables (no RANK) form one dp2 world: the losses of the
    locally spawned dp2 run, bitwise. SIGTERM to each task, as srun passes on a preemption,
    stops them after a step with a checkpoint and exit code 143. From that checkpoint,
    `--dp auto` on a world of 1 (torchrun's variables) resumes with dp 1 and the same global
    batch: the losses of a `--dp 1` run resumed from it, and of the run never stopped."""
    marker = f"PLAIT_TEST_MARK_{uuid.uuid4().hex}"
    run, job = tmp_path / "srun", _free_job_id()
    cmd = [sys.executable, "-m", "plait.cli", "train", *TINY, *CONSTANT_LR, "--steps", "100000",
           "--out", str(run)]  # fmt: skip
    tasks = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**_srun_env(rank, job), marker: "1"}, start_new_session=True)
        for rank in (0, 1)
    ]  # fmt: skip

    def preempt() -> None:
        for task in tasks:
            task.send_signal(signal.SIGTERM)

    try:
        err = _signal_after_rows(tasks[0], run / "metrics.jsonl", preempt)
        tasks[1].communicate(timeout=60)
    finally:
        for task in tasks:
            if task.poll() is None:
                os.killpg(task.pid, signal.SIGKILL)
    assert [t.returncode for t in tasks] == [143, 143], err[-3000:]
    assert processes_with(marker) == []
    done = len(_losses(run))
    assert 0 < done < PLAIN_STEPS - 2
    assert f"plait: stopped by SIGTERM after step {done}; checkpoint " in err
    assert _losses(run) == _losses(plain[1])[:done]  # bitwise: the same layout
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    resume = [*TINY, "--resume", str(run / "checkpoints" / f"step-{done}"),
              "--steps", str(done + 2), *CONSTANT_LR]  # fmt: skip
    assert main(["train", *resume, "--dp", "1", "--out", str(tmp_path / "dp1")]) == 0
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    assert main(["train", *resume, "--dp", "auto", "--out", str(tmp_path / "auto")]) == 0
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert summary["layout"].startswith("dp=1") and summary["world_size"] == 1
    elastic = _losses(tmp_path / "auto")
    assert len(elastic) == 2 and elastic == _losses(tmp_path / "dp1")
    assert elastic == pytest.approx(_losses(plain[1])[done : done + 2], rel=1e-5)
