"""Where plait's data parallelism spends Python time per step (a diagnostic, not a comparison).

plait's data parallelism is the ZeRO engine at stage 0; its gradient buckets are the
engine's `GradReducer` (`engine.grads`). This script subclasses `GradReducer` and `Comm`
(no patching): it builds the engine, removes the hooks of the reducer the engine made, and
puts in its place a timed reducer built with the same arguments. It times, per step on each
rank: the gradient hooks `_on_grad` (including the bucket launches they trigger), the
`Comm.all_reduce` calls among them, backward and `finish()`; when each bucket was launched
and when its parameters' gradients arrived, relative to the end of backward; and, outside
backward (no contention with compute), the cost of an async `Comm.all_reduce` call against a
bare async `torch.distributed.all_reduce` call on the same buffer. Timers add their own
overhead, and launches inside backward compete with the previous bucket's gloo thread for
the core, so the in-backward figures are upper bounds. Like the old `DataParallel` version,
a step is backward + `finish()` + `zero_grad()` only: no norm, no optimizer step.

    .venv/bin/python benchmarks/profile_dp_hooks.py --micro-batch 1 --seq-len 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median, spawn
from plait.build.model import build_model
from plait.comm import Comm
from plait.config import OptimConfig
from plait.mesh import build_mesh
from plait.models.presets import get_preset
from plait.parallel.adamw import AdamW
from plait.parallel.zero.engine import ZeroEngine
from plait.parallel.zero.options import ZeroOptions
from plait.parallel.zero.reducer import GradReducer
from plait.topology import Layout


class TimedComm(Comm):
    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.all_reduce_s = 0.0
        self.launch_at: list[float] = []

    def all_reduce(self, *a, **k):
        start = time.perf_counter()
        handle = super().all_reduce(*a, **k)
        self.all_reduce_s += time.perf_counter() - start
        self.launch_at.append(start)
        return handle


class TimedReducer(GradReducer):
    hook_s = 0.0
    ready_at: dict | None = None

    def _on_grad(self, p) -> None:  # registered as a bound method, so this one runs
        start = time.perf_counter()
        if self.ready_at is not None:
            self.ready_at[p] = start
        super()._on_grad(p)
        self.hook_s += time.perf_counter() - start


def timed_engine(model, comm: TimedComm, bucket_mb: float) -> ZeroEngine:
    """plait's data parallelism (ZeRO stage 0, fp32) with its reducer replaced by a
    `TimedReducer` made with the arguments `ZeroEngine.__init__` gives `GradReducer`."""
    optimizer = AdamW.from_optim(OptimConfig())  # built but never stepped here
    engine = ZeroEngine(model, comm, optimizer, ZeroOptions(stage=0, bucket_mb=bucket_mb))
    engine.grads.remove_hooks()
    engine.grads = TimedReducer(
        engine.groups,
        comm,
        engine.axis,
        engine.stage,
        engine.precision.reduce_dtype,
        engine.device,
        engine.memory,
        engine.gatherer.release if engine.gatherer else None,
    )
    return engine


def bucket_timeline(grads: TimedReducer, comm: TimedComm, end: float) -> list[dict]:
    """Per bucket: ms before the end of backward that its first and last gradient arrived
    and that it was launched (0 = at the end of backward)."""
    rows = []
    for g, launched in zip(grads.groups, comm.launch_at, strict=True):
        ready = [grads.ready_at[p] for p in g.params]
        rows.append(
            {
                "bucket": g.index,
                "params": len(g.params),
                "numel": g.numel,
                "first_grad_ms_before_end": (end - min(ready)) * 1e3,
                "last_grad_ms_before_end": (end - max(ready)) * 1e3,
                "launch_ms_before_end": (end - launched) * 1e3,
            }
        )
    return rows


def call_cost(comm: Comm, group, reps: int = 50) -> tuple[float, float]:
    """Median seconds of an async Comm.all_reduce call vs a bare dist.all_reduce call."""
    buf = torch.zeros(200_000)
    wrapped, bare = [], []
    for _ in range(reps):
        start = time.perf_counter()
        handle = comm.all_reduce(buf, "dp", op="avg", tag="probe", async_op=True)
        wrapped.append(time.perf_counter() - start)
        handle.wait()
        start = time.perf_counter()
        work = dist.all_reduce(buf, group=group, async_op=True)
        bare.append(time.perf_counter() - start)
        work.wait()
    return median(wrapped), median(bare)


def worker(rank: int, world: int, opts: argparse.Namespace) -> dict:
    device = torch.device("cpu")
    mesh = build_mesh(Layout(dp=world), device)
    model = build_model(get_preset(opts.model), device, 0)
    comm = TimedComm(mesh)
    engine = timed_engine(model, comm, opts.bucket_mb)
    grads = engine.grads
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (opts.micro_batch, opts.seq_len + 1), generator=g)
    hooks, launches, backward, finish, timelines = [], [], [], [], []
    for step in range(opts.warmup + opts.steps):
        grads.hook_s, comm.all_reduce_s, comm.launch_at, grads.ready_at = 0.0, 0.0, [], {}
        engine.micro_batch(is_last=True)
        loss = model(x[:, :-1], x[:, 1:])
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        engine.finish()
        t2 = time.perf_counter()
        engine.zero_grad()
        if step >= opts.warmup:
            hooks.append(grads.hook_s)
            launches.append(comm.all_reduce_s)
            backward.append(t1 - t0)
            finish.append(t2 - t1)
            timelines.append(bucket_timeline(grads, comm, t1))
        dist.barrier()
    wrapped, bare = call_cost(comm, mesh.group("dp"))
    timeline = [
        {k: (median([t[i][k] for t in timelines]) if "_ms_" in k else v) for k, v in row.items()}
        for i, row in enumerate(timelines[0])
    ]
    n_params = sum(len(group.params) for group in engine.groups)
    return {
        "machine": machine(),
        "config": vars(opts),
        "params": n_params,
        "buckets": len(engine.groups),
        "hooks_ms_per_step": median(hooks) * 1e3,
        "launches_in_hooks_ms_per_step": median(launches) * 1e3,
        "hook_bodies_us_per_param": (median(hooks) - median(launches)) / n_params * 1e6,
        "idle_comm_all_reduce_call_ms": wrapped * 1e3,
        "idle_bare_dist_all_reduce_call_ms": bare * 1e3,
        "backward_ms": median(backward) * 1e3,
        "finish_ms": median(finish) * 1e3,
        "bucket_timeline_median": timeline,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small-gpt")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", default=None)
    opts = ap.parse_args()
    res = spawn(worker, opts.world, opts)
    res["command"] = "python " + " ".join(sys.argv)
    for k, v in res.items():
        if k not in ("machine", "config", "bucket_timeline_median"):
            print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    print("bucket timeline on rank 0, medians in ms before the end of backward:")
    for row in res["bucket_timeline_median"]:
        print(
            "  "
            + ", ".join(
                f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            )
        )
    if opts.json:
        Path(opts.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
