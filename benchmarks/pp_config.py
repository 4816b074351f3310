"""What each side of `bench_pp.py` is built from: the schedules compared, the plait config of
one schedule (real mode) and the fixed micro-batches (fixed-cost mode).

Both sides of a pair are built from the same config and data, so the comparison is of the
pipeline implementations alone.
"""

from __future__ import annotations

import argparse

import torch

from plait.config import build_config
from plait.microbatch import MicroBatch

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def chunks_for(schedule: str, opts: argparse.Namespace) -> int:
    """Model chunks (virtual stages) per rank: only the interleaved schedule has several."""
    return opts.virtual_stages if schedule == "interleaved" else 1


def make_config(schedule: str, opts, world: int):
    """The Trainer config of one schedule; the torch side reads the same one."""
    m = opts.microbatches
    train = {
        "steps": 10_000,  # only sets the lr schedule's length
        "micro_batch": opts.micro_batch,
        "global_batch": opts.micro_batch * m,
        "seq_len": opts.seq_len,
        "eval_every": 0,
        "seed": opts.seed,
    }
    over = {
        "model": {"dropout": 0.0, "n_layers": opts.n_layers},
        "parallel": {
            "pp": world,
            "schedule": schedule,
            "virtual_stages": chunks_for(schedule, opts),
            "bucket_mb": opts.bucket_mb,
        },
        "data": {"max_bytes": opts.max_bytes},
        "train": train,
        "optim": {"lr": opts.lr, "warmup_steps": 10, "grad_clip": opts.clip},
        "log": {"progress": False, "out": "/tmp/plait-bench-pp-unused"},
    }
    cfg = build_config(opts.model, over)
    cfg.validate()
    return cfg


def fixed_micro(opts) -> list[MicroBatch]:
    """The `--microbatches` random-token micro-batches every fixed-cost step runs on."""
    g = torch.Generator().manual_seed(opts.seed)
    b, s = opts.micro_batch, opts.seq_len
    return [
        MicroBatch(
            torch.randint(0, 256, (b, s), generator=g),
            torch.randint(0, 256, (b, s), generator=g),
            torch.zeros(b, dtype=torch.int64),
        )
        for _ in range(opts.microbatches)
    ]
