"""`plait train` from the command line to the files it writes, its ranks in process.

The real command (flags, validation, checks of the output folder and of a checkpoint to
resume) and each rank's real run (`plait.run.run`), on the ranks of a harness world
instead of spawned workers (tests/in_process.py): pipeline traces and charts, 2BW with
tensor parallelism, ZeRO through a pipeline in fp16, and a save resumed under another
layout. The launcher is tested in test_launch.py.
"""

from __future__ import annotations

import json
import shutil

import in_process
from in_process import TINY
from plait.checkpoint import inspect
from plait.cli import main


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_pipeline_trace_chart_and_measured_bubble(world2, tmp_path):
    code, err = in_process.train(world2, [*TINY, "--out", str(tmp_path), "--dp", "1", "--pp",
                                          "2", "--microbatches", "4", "--schedule", "gpipe",
                                          "--trace"])  # fmt: skip
    assert code == 0, err[-3000:]
    name = "pipeline-gpipe-p2-m4-v1"
    trace = json.loads((tmp_path / f"{name}.trace.json").read_text())
    computes = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"][0] in "FB"]
    assert len(computes) == 2 * 2 * 4  # F and B of 4 micro-batches on each of 2 ranks
    assert (tmp_path / f"{name}.png").stat().st_size > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 0 < summary["pipeline"]["measured_bubble"] < 1
    assert summary["pipeline"]["simulated_bubble"] > 0
    assert "pipeline bubble (gpipe)" in err


def test_asynchronous_2bw_with_tensor_parallelism_from_the_command_line(world4, tmp_path):
    code, err = in_process.train(world4, [*TINY, "--out", str(tmp_path), "--dp", "1", "--pp",
                                          "2", "--microbatches", "2", "--schedule", "2bw",
                                          "--tp", "2", "--sequence-parallel"])  # fmt: skip
    assert code == 0, err[-3000:]
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "val_loss" in rows[-1]
    assert [r.get("drain", False) for r in rows] == [False, False, True, True]  # after the pipe
    assert f"checkpoint {tmp_path}/checkpoints/step-4:" in err  # both versions


def test_zero_with_pipeline_and_fp16_from_the_command_line(world2, tmp_path):
    code, err = in_process.train(world2, [*TINY, "--out", str(tmp_path), "--dp", "1", "--pp",
                                          "2", "--microbatches", "4", "--schedule", "zb-h1",
                                          "--zero", "1", "--precision", "fp16"])  # fmt: skip
    assert code == 0, err[-3000:]
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # The scaler starts at 2^16 and halves at each step whose gradients overflow (skipped);
    # which steps overflow depends on the windows drawn, so the rule is checked, not a count.
    scale = 2.0**16
    for r in rows:
        scale /= 2 if r["step_skipped"] else 1
        assert r["loss_scale"] == scale, rows
    assert sum(not r["step_skipped"] for r in rows) >= 3
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_save_then_resume_in_another_layout_from_the_command_line(world2, tmp_path):
    """dp2 ZeRO-2 saves at steps 2 and 4; the step-4 checkpoint is dropped as if the run had
    been killed after step 2's; `--resume latest` under tp2 + SP continues the metrics."""
    out = str(tmp_path)
    code, err = in_process.train(world2, [*TINY, "--out", out, "--zero", "2", "--save-every", "2"])
    assert code == 0, err
    assert f"checkpoint {out}/checkpoints/step-2:" in err
    full = _rows(tmp_path)
    assert "checkpoint_bytes" in full[1] and "checkpoint_s" in full[1]
    shutil.rmtree(tmp_path / "checkpoints" / "step-4")
    code, err = in_process.train(world2, [*TINY, "--out", out])
    assert code == 2 and "--resume latest to continue it" in err
    code, err = in_process.train(world2, [*TINY, "--out", out, "--dp", "1", "--tp", "2",
                                          "--sequence-parallel", "--global-batch", "4",
                                          "--resume", "latest"])  # fmt: skip
    assert code == 0, err
    assert f"resuming from {out}/checkpoints/step-2 at step 2\n" in err
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[:2] == full[:2]  # kept as written
    for mine, theirs in zip(rows[2:], full[2:], strict=True):
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * theirs["loss"]
    code, err = in_process.train(world2, [*TINY, "--out", out, "--resume", out,
                                          "--seq-len", "16", "--steps", "8"])  # fmt: skip
    assert code == 2  # a run folder given to --resume: its newest checkpoint, step 4
    assert f"checkpoint '{out}/checkpoints/step-4' was saved with train.seq_len=32; " in err
    assert "this run asks for 16" in err
    code, err = in_process.train(world2, [*TINY, "--out", out, "--resume", out, "--model",
                                          "tiny-llama", "--steps", "8"])  # fmt: skip
    assert code == 2
    assert "holds another model: tiny-gpt (" in err and "; this run asks for tiny-llama (" in err
    assert main(["checkpoint", "info", out]) == 0  # a run folder: its newest checkpoint
    assert inspect.info(tmp_path)["step"] == 4
