"""The run a lesson launches on every rank: train a few steps and keep what each step cost.

Unlike `plait train` (rank 0 writes metrics), every rank writes its own record: the lessons
compare ranks (rank 0's extra memory under naive DP, activations held per pipeline stage).

The first step alone runs under the memory tracker's activation meter (the bytes autograd
saves for backward, peak = most held at once). Its hook on every saved tensor costs time, about
a millisecond a step here: 3-20% of a lesson model's step, unevenly across recompute modes, so
metering every step would skew the timings the lessons compare. The first step is the one every
timing here leaves out (it pays for warm-up), and what a step saves is the same every step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from plait.config import Config
from plait.mesh import Mesh
from plait.schedule.measured import report
from plait.step import StepResult
from plait.train import Trainer


def measure(cfg: Config, mesh: Mesh) -> dict[str, Any]:
    """Train `cfg.train.steps` steps; return (and write as OUT/rank{r}.json) per step: loss,
    time, bytes by collective, memory by category (the first step: with saved activations);
    with `trace` the last step's pipeline report (Gantt chart and bubble, written by the
    logging rank)."""
    trainer = Trainer(cfg, mesh)
    steps = []
    pipeline = None
    try:
        for i in range(cfg.train.steps):
            meter = i == 0  # the first step alone (module doc)
            steps.append(step_row(trainer, trainer.train_step(meter_activations=meter), meter))
        if cfg.log.trace and trainer.pipeline is not None:
            timings = trainer.pipeline.gather_timings()  # collective over the pp axis
            if mesh.is_logging_rank:
                pipeline = report(trainer.pipeline.schedule, timings, Path(cfg.log.out))
    finally:
        trainer.close()
    return save_record(cfg, mesh, steps, pipeline=pipeline)


def save_record(cfg: Config, mesh: Mesh, steps: list[dict[str, Any]], **extra: Any) -> dict:
    """This rank's record (its steps and whatever else the target measured), written as
    OUT/rank{r}.json for the runner, which reads every rank's after the world ends."""
    record = {"rank": mesh.rank, "coord": dataclasses.asdict(mesh.coord), "steps": steps, **extra}
    out = Path(cfg.log.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{mesh.rank}.json").write_text(json.dumps(record))
    return record


def step_row(trainer: Trainer, result: StepResult, metered: bool = False) -> dict[str, Any]:
    """What one step cost: its loss, gradient norm and time, bytes by collective, memory by
    category (and, `metered`, the peak of saved activations)."""
    row: dict[str, Any] = {
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "time_s": result.time_s,
        "bytes": trainer.comm.stats.bytes_by_op(),
    }
    memory = trainer.engine.memory
    if memory is not None:
        row["memory"] = memory.report()
        if metered:
            row["activations"] = memory.peak("activations")
            row["activations_host"] = memory.peak("activations", "host")  # offloaded
    row["loss_scale"] = trainer.engine.loss_scale  # fp16's scaler (1.0 without one)
    row["skipped"] = trainer.engine.last_step_skipped
    return row
