"""`plait calibrate`'s probe of the pipeline runtime's own cost per action.

A pipeline step does more than its FLOPs and its messages: every compute action posts and
matches its receives and sends, builds its stage's autograd graph, hands tensors between
micro-batches, all in Python, and on a CPU whose cores the ranks share every hand-off waits
for the next rank to be scheduled. On a large model that is noise; on a small one it is most
of a pipelined step (a 4-stage pipeline of a 16-wide model with 16 micro-batches takes about
0.1 s a step here with next to no FLOPs in it).

The probe runs plait's own pipeline (the Trainer, 1F1B over every rank) on such a model, so
that almost all of its step is this cost, and solves for the seconds per compute action that
make the pipeline simulator (with the calibrated p2p time) reproduce the measured step. The
planner adds it to every F, B and W of a pipelined layout (`plan/step_time.py`).
"""

from __future__ import annotations

import statistics
import tempfile

import torch

from plait.config import build_config
from plait.mesh import build_mesh
from plait.schedule.schedules import build_schedule
from plait.schedule.simulate import Costs, simulate
from plait.topology import Layout
from plait.train import Trainer

PROBE_STEPS, PROBE_SKIP = 8, 2


def pipeline_step_seconds(world: int, micro_batches: int) -> float:
    """Median step time of plait's 1F1B pipeline over `world` ranks (every rank calls this
    together) on a model with next to no FLOPs: one block of width 16 per stage."""
    with tempfile.TemporaryDirectory(prefix="plait-calibrate-") as out:
        over = {
            "model": {"n_layers": world, "d_model": 16, "n_heads": 1, "vocab_size": 256},
            "parallel": {"pp": world, "schedule": "1f1b"},
            "data": {"max_bytes": 100_000},
            "train": {
                "global_batch": micro_batches,
                "micro_batch": 1,
                "seq_len": 16,
                "steps": PROBE_STEPS,
                "eval_every": 0,
            },
            "log": {"progress": False, "out": out},
        }
        cfg = build_config("small-gpt", over)
        cfg.validate()
        trainer = Trainer(cfg, build_mesh(Layout(pp=world), torch.device("cpu")))
        try:
            times = [trainer.train_step().time_s for _ in range(PROBE_STEPS)]
        finally:
            trainer.close()
    return statistics.median(times[PROBE_SKIP:])


def action_overhead(measured: float, p: int, m: int, p2p_s: float) -> float:
    """The seconds per compute action that make 1F1B over p ranks and m micro-batches, with
    messages taking `p2p_s`, last `measured` in the simulator (bisection: the makespan grows
    with the cost of every action); 0 when the messages alone explain it."""

    def span(o: float) -> float:
        return float(simulate(build_schedule("1f1b", p, m), Costs(o, o, 0, p2p_s)).makespan)

    if span(0.0) >= measured:
        return 0.0
    lo, hi = 0.0, measured
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if span(mid) < measured else (lo, mid)
    return (lo + hi) / 2
