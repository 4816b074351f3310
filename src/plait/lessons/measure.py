"""The run a lesson launches on every rank: train a few steps and keep what each step cost.

Unlike `plait train` (rank 0 writes metrics), every rank writes its own record: the lessons
compare ranks (rank 0's extra memory under naive DP, activations held per pipeline stage).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from plait.config import Config
from plait.mesh import Mesh
from plait.parallel.pipeline.output.report import report
from plait.train import Trainer


def measure(cfg: Config, mesh: Mesh) -> dict[str, Any]:
    """Train `cfg.train.steps` steps; return (and write as OUT/rank{r}.json) per step: loss,
    time, bytes by collective, memory by category; with `trace` the last step's pipeline
    report (Gantt chart and bubble, written by the logging rank)."""
    trainer = Trainer(cfg, mesh)
    steps = []
    pipeline = None
    try:
        for _ in range(cfg.train.steps):
            steps.append(_step_row(trainer))
        if cfg.train.trace and trainer.pipeline is not None:
            timings = trainer.pipeline.gather_timings()  # collective over the pp axis
            if mesh.is_logging_rank:
                pipeline = report(trainer.pipeline.schedule, timings, Path(cfg.train.out))
    finally:
        trainer.close()
    record = {"rank": mesh.rank, "coord": dataclasses.asdict(mesh.coord), "steps": steps}
    record["pipeline"] = pipeline
    out = Path(cfg.train.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{mesh.rank}.json").write_text(json.dumps(record))
    return record


def _step_row(trainer: Trainer) -> dict[str, Any]:
    result = trainer.train_step()
    row: dict[str, Any] = {
        "loss": result.loss,
        "time_s": result.time_s,
        "bytes": trainer.comm.stats.bytes_by_op(),
    }
    if trainer.engine.memory is not None:
        row["memory"] = trainer.engine.memory.report()
    if trainer.zero is not None:
        row["loss_scale"] = trainer.zero.loss_scale
        row["skipped"] = trainer.zero.last_step_skipped
    return row
