"""plait data parallelism vs torch DistributedDataParallel: same model, world, batches, AdamW.

One process group, two replicas of the same model per rank (same seed, so the same initial
weights): one driven by plait's data parallelism, the ZeRO engine at stage 0 (`ZeroEngine`
with `ZeroOptions(stage=0)`: flat gradient buckets, the global norm of `plait.parallel.grads`,
the engine's element-wise AdamW), one wrapped by `DistributedDataParallel` with torch's AdamW from
`plait.optim.build_optimizer` (same groups and hyper-parameters). After warm-up, rounds
alternate a block of K plait steps with a block of K DDP steps (the order flips every round).
A step is timed on every rank and the per-step figure is the max over ranks, taken by an
all-reduce MAX outside the timed region (it also lines the ranks up before the next step).

Both sides see the same sequence of batches (batch i of a side's own step count), so their
losses should agree step by step up to reduction order: the table reports the largest
difference as a check that both did the same work.

    .venv/bin/python benchmarks/bench_dp.py --world 2 --rounds 40 --steps 5 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Side,
    alternate,
    cycled_step,
    loss_diffs,
    machine,
    max_over_ranks,
    pair_ratios,
    spawn,
    step_figures,
    synthetic_batches,
    threads_for,
)
from output import (
    TIME_COLUMNS,
    ddp_bucket_sizes,
    machine_line,
    markdown_table,
    phase_table,
    publish,
    ratio_line,
    time_cells,
)
from plait.build.model import build_model
from plait.comm import Comm
from plait.config import OptimConfig
from plait.mesh import build_mesh
from plait.models.presets import get_preset
from plait.optim import build_optimizer
from plait.parallel.adamw import AdamW
from plait.parallel.grads import SplitGradRules, clip_coef
from plait.parallel.zero.engine import ZeroEngine
from plait.parallel.zero.options import ZeroOptions
from plait.topology import Layout
from plait.torch_private import ddp_logging_data

PHASES = ("forward", "backward", "finish", "clip", "optim", "zero")


def make_batches(opts: argparse.Namespace, rank: int, world: int, vocab: int) -> list:
    """`opts.pool` steps of `opts.accum` micro-batches (x, y) for this rank."""
    b, s, n = opts.micro_batch, opts.seq_len, opts.pool * opts.accum
    if opts.data == "synthetic":
        micro = synthetic_batches(1000 * opts.seed + rank, n, b, s, vocab)
    else:  # real text: the default corpus (the Python standard library's sources)
        from plait.data import TokenWindows, load_tokens

        windows = TokenWindows(load_tokens(opts.data_path, opts.max_bytes), s)
        need = n * b * world
        if len(windows) < need:
            raise SystemExit(f"corpus has {len(windows)} windows, need {need}; raise --max-bytes")
        g = torch.Generator().manual_seed(opts.seed)
        order = torch.randperm(len(windows), generator=g)[:need].view(n, world, b)
        micro = [windows.batch(order[i, rank]) for i in range(n)]
    return [micro[i * opts.accum : (i + 1) * opts.accum] for i in range(opts.pool)]


class PlaitSide(Side):
    """plait's data parallelism (the ZeRO engine at stage 0) and step, with per-phase timings."""

    def __init__(self, model, comm: Comm, opts, train_cfg: OptimConfig) -> None:
        super().__init__("plait", PHASES)
        self.model, self.comm, self.clip, self.lr = model, comm, opts.clip, train_cfg.lr
        optimizer = AdamW.from_optim(train_cfg)
        self.dp = ZeroEngine(model, comm, optimizer, ZeroOptions(stage=0, bucket_mb=opts.bucket_mb))
        self.rules = SplitGradRules.of(model, comm.mesh)
        self.step = 0
        self.grad_bytes: list[int] = []
        self.grad_calls: list[int] = []

    def run_step(self, micro: list) -> dict[str, float]:
        ph = dict.fromkeys(PHASES, 0.0)
        clock = time.perf_counter
        self.comm.stats.begin_step(self.step)
        n, loss_sum = len(micro), 0.0
        for i, (x, y) in enumerate(micro):
            t0 = clock()
            self.dp.micro_batch(is_last=i == n - 1)
            loss = self.model(x, y)
            t1 = clock()
            (loss / n).backward()
            t2 = clock()
            ph["forward"] += t1 - t0
            ph["backward"] += t2 - t1
            loss_sum += float(loss.detach())
        t0 = clock()
        self.dp.finish()
        t1 = clock()
        if self.clip > 0:  # clip 0 = off on both sides (torch's clip_grad_norm_(0) zeroes)
            self.dp.clip(clip_coef(self.dp.grad_norm(self.rules), self.clip))
        t2 = clock()
        self.dp.step(self.lr)
        t3 = clock()
        self.dp.zero_grad()
        t4 = clock()
        ph.update(finish=t1 - t0, clip=t2 - t1, optim=t3 - t2, zero=t4 - t3)
        calls, _, nbytes = self.comm.stats.total(op="all_reduce", tag="grad")
        self.grad_bytes.append(nbytes)
        self.grad_calls.append(calls)
        self.step += 1
        self.losses.append(loss_sum / n)
        return ph

    def comm_figures(self) -> dict:
        """Gradient all-reduce traffic of the last step and the bucket layout, for the JSON."""
        return {
            "grad_allreduce_bytes_per_step": self.grad_bytes[-1],
            "grad_allreduce_calls_per_step": self.grad_calls[-1],
            "buckets": len(self.dp.groups),
            "launch_log_last_step": self.dp.grads.launch_log,
            "bucket_numels": [g.padded for g in self.dp.groups],
        }


class DDPSide(Side):
    """The DDP replica with the same optimizer and step, timed by the same phases."""

    def __init__(self, model, opts, train_cfg: OptimConfig) -> None:
        super().__init__("ddp", PHASES)
        self.module, self.clip = model, opts.clip
        self.ddp = DDP(
            model, bucket_cap_mb=opts.bucket_mb, gradient_as_bucket_view=opts.ddp_grad_view
        )
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = build_optimizer(model, train_cfg)

    def run_step(self, micro: list) -> dict[str, float]:
        ph = dict.fromkeys(PHASES, 0.0)
        clock = time.perf_counter
        n, loss_sum = len(micro), 0.0
        for i, (x, y) in enumerate(micro):
            ctx = self.ddp.no_sync() if i < n - 1 else contextlib.nullcontext()
            with ctx:
                t0 = clock()
                loss = self.ddp(x, y)
                t1 = clock()
                (loss / n).backward()  # DDP waits for its last bucket inside backward
                t2 = clock()
            ph["forward"] += t1 - t0
            ph["backward"] += t2 - t1
            loss_sum += float(loss.detach())
        t0 = clock()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        t1 = clock()
        self.opt.step()
        t2 = clock()
        self.opt.zero_grad(set_to_none=True)
        t3 = clock()
        ph.update(clip=t1 - t0, optim=t2 - t1, zero=t3 - t2)
        self.losses.append(loss_sum / n)
        return ph

    def bucket_info(self) -> dict:
        data = ddp_logging_data(self.ddp)
        sizes = data.get("bucket_sizes", "")
        return {"bucket_sizes": sizes, "rebuilt_bucket_sizes": data.get("rebuilt_bucket_sizes")}


def worker(rank: int, world: int, opts: argparse.Namespace) -> dict:
    device = torch.device("cpu")
    cfg = get_preset(opts.model)
    mesh = build_mesh(Layout(dp=world), device)
    comm = Comm(mesh)
    train_cfg = OptimConfig(lr=opts.lr)
    plait_side = PlaitSide(build_model(cfg, device, opts.seed), comm, opts, train_cfg)
    ddp_side = DDPSide(build_model(cfg, device, opts.seed), opts, train_cfg)
    batches = make_batches(opts, rank, world, cfg.vocab_size)
    step = cycled_step(batches, unpack=False)  # a batch is the step's list of micro-batches
    alternate(
        [(plait_side, ddp_side)], step, warmup=opts.warmup, rounds=opts.rounds, steps=opts.steps
    )
    max_diff = max_over_ranks(max(loss_diffs(plait_side, ddp_side)))
    params = sum(p.numel() for p in plait_side.model.parameters())
    return {
        "machine": machine(),
        "config": {**vars(opts), "threads_per_rank": threads_for(world), "params": params},
        "plait": {**step_figures(plait_side), **plait_side.comm_figures()},
        "ddp": {**step_figures(ddp_side), **ddp_side.bucket_info()},
        **pair_ratios(plait_side, ddp_side, per_block=True),
        "max_loss_diff": max_diff,
        "final_loss": {"plait": plait_side.losses[-1], "ddp": ddp_side.losses[-1]},
    }


def report(res: dict, target: float) -> str:
    """The markdown printed at the end of a run (the JSON holds everything else)."""
    p, d, c = res["plait"], res["ddp"], res["config"]
    rows = [
        ["plait", *time_cells(p), p["buckets"], p["grad_allreduce_bytes_per_step"]],
        ["DDP", *time_cells(d), _ddp_buckets(d), _ddp_bytes(d)],
    ]
    lines = [
        f"### plait ZeRO-0 (data parallel) vs DDP: {c['model']} ({c['params']:,} params), world "
        f"{c['world']}, micro-batch {c['micro_batch']} x seq {c['seq_len']} x accum "
        f"{c['accum']}, {c['data']} data, bucket {c['bucket_mb']} MiB",
        "",
        machine_line(res, c["threads_per_rank"]),
        "",
        markdown_table(["impl", *TIME_COLUMNS, "buckets", "grad bytes/step"], rows),
        "",
        ratio_line(res, "DDP", target)
        + f"; max |loss diff| plait vs DDP {res['max_loss_diff']:.2e}",
        "",
        f"plait bucket launches in its last step: {_launches(p)}",
        "",
        "Median per-phase time on rank 0 (ms):",
        "",
        phase_table("impl", PHASES, (("plait", p), ("DDP", d))),
    ]
    return "\n".join(lines)


def _launches(p: dict) -> str:
    log = p["launch_log_last_step"]
    during = sum(1 for _, when in log if when == "backward")
    return f"{during} of {len(log)} during backward (overlapped), {len(log) - during} in finish()"


def _ddp_buckets(d: dict) -> int | str:
    return len(ddp_bucket_sizes(d)) or "?"


def _ddp_bytes(d: dict) -> int | str:
    """DDP all-reduces each bucket once per synchronized step: the sum of bucket sizes."""
    return sum(ddp_bucket_sizes(d)) or "?"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small-gpt", help="plait preset name")
    ap.add_argument("--world", type=int, default=2, help="ranks (gloo, CPU)")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="plait bucket_mb = DDP cap")
    ap.add_argument("--ddp-grad-view", action="store_true", help="gradient_as_bucket_view")
    ap.add_argument("--clip", type=float, default=1.0, help="grad-norm clip (both sides); 0 = off")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--data", choices=("synthetic", "real"), default="synthetic")
    ap.add_argument("--data-path", default=None, help="real data: file or folder")
    ap.add_argument("--max-bytes", type=int, default=2_000_000, help="real data: bytes read")
    ap.add_argument("--pool", type=int, default=8, help="distinct batches cycled through")
    ap.add_argument("--warmup", type=int, default=5, help="unrecorded steps per side")
    ap.add_argument("--rounds", type=int, default=40, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=5, help="steps per block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=1.05, help="ratio to meet")
    ap.add_argument("--json", default=None, help="save results here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    res = spawn(worker, opts.world, opts)
    publish(res, report(res, opts.target), opts.json)


if __name__ == "__main__":
    main()
