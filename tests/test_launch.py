"""End to end through the real command: local spawn, torchrun, and failure on one rank."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

TINY = [
    "--model", "tiny-gpt", "--dp", "2", "--steps", "4", "--seq-len", "32",
    "--global-batch", "4", "--micro-batch", "1", "--eval-batches", "1", "--eval-every", "2",
    "--max-bytes", "200000", "--no-progress",
]  # fmt: skip


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


def _processes_with(marker: str) -> list[int]:
    """PIDs whose environment carries `marker` (children inherit it; orphans would too)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_train_dp2_writes_metrics_and_summary(tmp_path):
    proc = _plait(["--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all({"loss", "lr", "grad_norm", "tokens_per_s", "comm_bytes"} <= r.keys() for r in rows)
    assert rows[0]["comm_bytes"]["all_reduce"] > 0
    assert "val_loss" in rows[1] and "val_loss" in rows[3]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["layout"].startswith("dp=2")
    assert "unigram baseline" in proc.stderr


def test_failure_on_one_rank_stops_all_with_its_traceback(tmp_path):
    marker = f"PLAIT_TEST_MARK_{uuid.uuid4().hex}"
    temp = tmp_path / "temp"  # the run's temporary folder: nothing may be left in it
    temp.mkdir()
    env = {"PLAIT_FAULT": "1:2", marker: "1", "TMPDIR": str(temp)}
    proc = _plait(["--out", str(tmp_path / "run")], env=env)
    assert proc.returncode == 1
    assert "a worker failed; all ranks stopped" in proc.stderr
    assert "rank 1 failed first" in proc.stderr
    assert "injected fault (PLAIT_FAULT=1:2) on rank 1 at step 2" in proc.stderr
    assert "Traceback" in proc.stderr
    assert _processes_with(marker) == []  # no orphan worker left behind
    left = [p.name for p in temp.iterdir() if p.name != "torchinductor_root"]  # torch's cache
    assert left == []  # no pytorch-errorfile-*, no plait-errors-* folder
    # what rank 0 wrote before the failure is on disk, line by line
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize(
    ("signum", "group"), [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "term"]
)
def test_a_signal_ends_the_step_saves_and_exits(signum, group, tmp_path):
    """Ctrl-C (SIGINT to the whole group) or SIGTERM to the launcher alone: every rank finishes
    its step, a checkpoint is written, one line says where, the exit code is 128 + signal;
    no worker is left, every metrics line is whole, and the run resumes from there."""
    marker = f"PLAIT_TEST_MARK_{uuid.uuid4().hex}"
    cmd = [sys.executable, "-m", "plait.cli", "train", *TINY, "--steps", "100000"]
    cmd += ["--out", str(tmp_path)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, marker: "1"}, start_new_session=True,
    )  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 90
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        os.killpg(proc.pid, signum) if group else proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err
    assert _processes_with(marker) == []
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    done = len(rows)
    assert "plait: stopped by " in err and f"after step {done}; checkpoint " in err
    assert (tmp_path / "checkpoints" / f"step-{done}" / "COMMITTED").exists()
    resumed = _plait(["--out", str(tmp_path), "--resume", "latest", "--steps", str(done + 1)])
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in map(json.loads, metrics.read_text().splitlines())][-1] == done


def test_under_torchrun_uses_its_environment(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--standalone", "-m", "plait.cli"]
    proc = _plait(["--out", str(tmp_path)], launcher=torchrun)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2


def test_torchrun_world_must_match_layout(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    torchrun += ["--standalone", "-m", "plait.cli"]
    proc = _plait(["--out", str(tmp_path)], launcher=torchrun)
    assert proc.returncode != 0
    assert "world size 1 != dp*pp*tp = 2*1*1 = 2" in proc.stderr


def test_pipeline_trace_chart_and_measured_bubble(tmp_path):
    proc = _plait(["--out", str(tmp_path), "--dp", "1", "--pp", "2", "--microbatches", "4",
                   "--schedule", "gpipe", "--trace"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = "pipeline-gpipe-p2-m4-v1"
    trace = json.loads((tmp_path / f"{name}.trace.json").read_text())
    computes = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"][0] in "FB"]
    assert len(computes) == 2 * 2 * 4  # F and B of 4 micro-batches on each of 2 ranks
    assert (tmp_path / f"{name}.png").stat().st_size > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 0 < summary["pipeline"]["measured_bubble"] < 1
    assert summary["pipeline"]["simulated_bubble"] > 0
    assert "pipeline bubble (gpipe)" in proc.stderr


def test_asynchronous_2bw_with_tensor_parallelism_from_the_command_line(tmp_path):
    proc = _plait(["--out", str(tmp_path), "--dp", "1", "--pp", "2", "--microbatches", "2",
                   "--schedule", "2bw", "--tp", "2", "--sequence-parallel"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "val_loss" in rows[-1]
    assert [r.get("drain", False) for r in rows] == [False, False, True, True]  # after the pipe
    assert "no checkpoint: 2bw runs cannot be saved yet" in proc.stderr


def test_zero_with_pipeline_and_fp16_from_the_command_line(tmp_path):
    proc = _plait(["--out", str(tmp_path), "--dp", "1", "--pp", "2", "--microbatches", "4",
                   "--schedule", "zb-h1", "--zero", "1", "--precision", "fp16"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["loss_scale"] == 2.0**16 and not r["step_skipped"] for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_save_then_resume_in_another_layout_from_the_command_line(tmp_path):
    """dp2 ZeRO-2 saves at steps 2 and 4; the step-4 checkpoint is dropped as if the run had
    been killed after step 2's; `--resume latest` under tp2 + SP continues the metrics."""
    out = str(tmp_path)
    first = _plait(["--out", out, "--zero", "2", "--save-every", "2"])
    assert first.returncode == 0, first.stderr
    assert f"checkpoint {out}/checkpoints/step-2:" in first.stderr
    full = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "checkpoint_bytes" in full[1] and "checkpoint_s" in full[1]
    shutil.rmtree(tmp_path / "checkpoints" / "step-4")
    again = _plait(["--out", out])
    assert again.returncode == 2 and "--resume latest to continue it" in again.stderr
    resumed = _plait(["--out", out, "--dp", "1", "--tp", "2", "--sequence-parallel",
                      "--global-batch", "4", "--resume", "latest"])  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[:2] == full[:2]  # kept as written
    for mine, theirs in zip(rows[2:], full[2:], strict=True):
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * theirs["loss"]
    changed = _plait(["--out", out, "--resume", "latest", "--seq-len", "16", "--steps", "8"])
    assert changed.returncode == 2
    assert "saved with train.seq_len=32; this run asks for 16" in changed.stderr


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_killed_rank_restarts_from_the_newest_checkpoint(tmp_path):
    """Rank 1 dies at step 3 after the step-2 checkpoint; with --max-restarts 1 the world
    starts again from it and ends with the uninterrupted run's losses and summary."""
    plain = _plait(["--out", str(tmp_path / "plain")])
    assert plain.returncode == 0, plain.stderr
    out = tmp_path / "restarted"
    proc = _plait(["--out", str(out), "--save-every", "2", "--max-restarts", "1"],
                  env={"PLAIT_FAULT": "1:3"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "plait: rank 1 failed (RuntimeError: injected fault" in proc.stderr
    assert f"restart 1/1 from {out}/checkpoints/step-2" in proc.stderr
    assert _losses(out) == _losses(tmp_path / "plain")  # bitwise: same layout
    assert json.loads((out / "summary.json").read_text())["restarts"] == 1


def test_a_save_cut_short_leaves_the_previous_checkpoint(tmp_path):
    """Rank 1 dies while the step-4 checkpoint is written: that folder is never committed,
    and --resume latest continues from step 2 with a warning."""
    out = tmp_path / "cut"
    proc = _plait(["--out", str(out), "--save-every", "2"], env={"PLAIT_FAULT": "1:save-4"})
    assert proc.returncode == 1 and "injected fault (PLAIT_FAULT=1:save-4)" in proc.stderr
    assert not (out / "checkpoints" / "step-4" / "COMMITTED").exists()
    before = _losses(out)  # steps 0-2: step 3's row waits for its checkpoint
    resumed = _plait(["--out", str(out), "--resume", "latest", "--steps", "6"])
    assert resumed.returncode == 0, resumed.stderr
    assert "step-4: the save did not finish" in resumed.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert _losses(out)[:2] == before[:2]  # the rows before the checkpoint are kept
