"""The run the tensor-parallel lesson launches on every rank: plait's training step, with the
collectives of each step split into forward, backward and once-per-step work by measurement
(phases.py), then the column vs row probes (split.py) on the same world.

The step is plait's own `Step` over its `Accumulate` runner and the trainer's model, engine,
rules and batches, exactly what `Trainer.train_step` runs for this layout; only the runner
is wrapped, to mark where the micro-batches end.
"""

from __future__ import annotations

from typing import Any

from plait.config import Config
from plait.lessons.column_row import measure_split
from plait.lessons.measure import save_record, step_row
from plait.lessons.phases import MarkedRunner, PhaseMeter
from plait.mesh import Mesh
from plait.step import Accumulate, Step
from plait.train import Trainer


def measure_tp(cfg: Config, mesh: Mesh) -> dict[str, Any]:
    """Train `cfg.train.steps` steps; per step the measure row plus its phases; then the
    column/row probes. Writes OUT/rank{r}.json."""
    if cfg.parallel.pp > 1 or cfg.parallel.dp_mode != "ddp" or cfg.parallel.two_bw:
        raise ValueError(
            "measure_tp runs the plain accumulation step: no pipeline, naive DP or 2BW"
        )
    trainer = Trainer(cfg, mesh)
    meter = PhaseMeter(trainer.comm.stats)
    runner = MarkedRunner(Accumulate(trainer.model, trainer.engine, trainer.batches), meter)
    step = Step(trainer.engine, runner, trainer.grad_rules, trainer.comm, cfg.train, cfg.optim)
    steps = []
    try:
        with meter.attached(trainer.model):
            for k in range(cfg.train.steps):
                row = step_row(trainer, step(k))
                steps.append(row | {"phases": meter.take()})
    finally:
        trainer.close()
    t = cfg.train
    split = measure_split(cfg.model, t.micro_batch, t.seq_len, mesh)
    return save_record(cfg, mesh, steps, split=split)
