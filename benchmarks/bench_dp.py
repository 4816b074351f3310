"""plait DataParallel vs torch DistributedDataParallel: same model, world, batches, optimizer.

One process group, two replicas of the same model per rank (same seed, so the same initial
weights): one wrapped by plait's `DataParallel`, one by `DistributedDataParallel`, each with
its own AdamW from `plait.optim.build_optimizer`. After warm-up, rounds alternate a block of
K plait steps with a block of K DDP steps (the order flips every round). A step is timed on
every rank and the per-step figure is the max over ranks, taken by an all-reduce MAX outside
the timed region (it also lines the ranks up before the next step).

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
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    describe_machine_md,
    machine,
    markdown_table,
    max_over_ranks,
    median,
    paired_ratio,
    save_json,
    spawn,
    summarize,
    threads_for,
)
from plait.comm import Comm
from plait.config import TrainConfig
from plait.mesh import build_mesh
from plait.models.presets import get_preset
from plait.optim import build_optimizer, clip_grad_norm
from plait.parallel.data_parallel import DataParallel
from plait.topology import Layout
from plait.train import build_model

PHASES = ("forward", "backward", "finish", "clip", "optim", "zero")


def make_batches(opts: argparse.Namespace, rank: int, world: int, vocab: int) -> list:
    """`opts.pool` steps of `opts.accum` micro-batches (x, y) for this rank."""
    b, s, n = opts.micro_batch, opts.seq_len, opts.pool * opts.accum
    if opts.data == "synthetic":
        g = torch.Generator().manual_seed(1000 * opts.seed + rank)
        toks = torch.randint(0, vocab, (n, b, s + 1), generator=g)
        micro = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks]
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


class Side:
    """One implementation's replica, optimizer and step, with per-phase timings."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.times: list[float] = []  # max over ranks, seconds, measured steps only
        self.block_medians: list[float] = []
        self.phases: dict[str, list[float]] = {p: [] for p in PHASES}
        self.losses: list[float] = []

    def run_step(self, micro: list) -> dict[str, float]:
        raise NotImplementedError


class PlaitSide(Side):
    def __init__(self, model, comm: Comm, opts, train_cfg: TrainConfig) -> None:
        super().__init__("plait")
        self.model, self.comm, self.clip = model, comm, opts.clip
        self.dp = DataParallel(model, comm, opts.bucket_mb)
        self.opt = build_optimizer(model, train_cfg)
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
            clip_grad_norm(self.dp.grad_buffers(), self.clip)
        t2 = clock()
        self.opt.step()
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


class DDPSide(Side):
    def __init__(self, model, opts, train_cfg: TrainConfig) -> None:
        super().__init__("ddp")
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
        data = self.ddp._get_ddp_logging_data()
        sizes = data.get("bucket_sizes", "")
        return {"bucket_sizes": sizes, "rebuilt_bucket_sizes": data.get("rebuilt_bucket_sizes")}


def run_block(side: Side, batches: list, steps: int, record: bool) -> None:
    block = []
    for _ in range(steps):
        micro = batches[len(side.losses) % len(batches)]
        start = time.perf_counter()
        ph = side.run_step(micro)
        elapsed = time.perf_counter() - start
        step_max = max_over_ranks(elapsed)  # outside the timed region; also a barrier
        if record:
            side.times.append(step_max)
            block.append(step_max)
            for k, v in ph.items():
                side.phases[k].append(v)
    if record:
        side.block_medians.append(median(block))


def worker(rank: int, world: int, opts: argparse.Namespace) -> dict:
    device = torch.device("cpu")
    cfg = get_preset(opts.model)
    mesh = build_mesh(Layout(dp=world), device)
    comm = Comm(mesh)
    train_cfg = TrainConfig(lr=opts.lr, seq_len=opts.seq_len, micro_batch=opts.micro_batch)
    plait_side = PlaitSide(build_model(cfg, device, opts.seed), comm, opts, train_cfg)
    ddp_side = DDPSide(build_model(cfg, device, opts.seed), opts, train_cfg)
    batches = make_batches(opts, rank, world, cfg.vocab_size)

    for side in (plait_side, ddp_side):
        run_block(side, batches, opts.warmup, record=False)
    for r in range(opts.rounds):
        order = (plait_side, ddp_side) if r % 2 == 0 else (ddp_side, plait_side)
        for side in order:
            run_block(side, batches, opts.steps, record=True)

    n = min(len(plait_side.losses), len(ddp_side.losses))
    diffs = [abs(a - b) for a, b in zip(plait_side.losses[:n], ddp_side.losses[:n], strict=True)]
    diff_t = torch.tensor([max(diffs)], dtype=torch.float64)
    dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
    params = sum(p.numel() for p in plait_side.dp.params)
    return {
        "machine": machine(),
        "config": {**vars(opts), "threads_per_rank": threads_for(world), "params": params},
        "plait": {
            **summarize(plait_side.times),
            "phases_median_ms": {k: median(v) * 1e3 for k, v in plait_side.phases.items()},
            "times_ms": [t * 1e3 for t in plait_side.times],
            "grad_allreduce_bytes_per_step": plait_side.grad_bytes[-1],
            "grad_allreduce_calls_per_step": plait_side.grad_calls[-1],
            "buckets": len(plait_side.dp.buckets),
            "launch_log_last_step": plait_side.dp.launch_log,
            "bucket_numels": [b.buffer.numel() for b in plait_side.dp.buckets],
        },
        "ddp": {
            **summarize(ddp_side.times),
            "phases_median_ms": {k: median(v) * 1e3 for k, v in ddp_side.phases.items()},
            "times_ms": [t * 1e3 for t in ddp_side.times],
            **ddp_side.bucket_info(),
        },
        "ratio_of_medians": median(plait_side.times) / median(ddp_side.times),
        "paired_block_ratio": paired_ratio(plait_side.block_medians, ddp_side.block_medians),
        "block_ratios": [
            a / b for a, b in zip(plait_side.block_medians, ddp_side.block_medians, strict=True)
        ],
        "max_loss_diff": float(diff_t.item()),
        "final_loss": {"plait": plait_side.losses[-1], "ddp": ddp_side.losses[-1]},
    }


def report(res: dict, target: float) -> str:
    p, d, c = res["plait"], res["ddp"], res["config"]
    ratio = res["ratio_of_medians"]
    verdict = "meets" if ratio <= target else "misses"
    lines = [
        f"### plait DataParallel vs DDP: {c['model']} ({c['params']:,} params), world "
        f"{c['world']}, micro-batch {c['micro_batch']} x seq {c['seq_len']} x accum "
        f"{c['accum']}, {c['data']} data, bucket {c['bucket_mb']} MiB",
        "",
        f"Machine: {describe_machine_md(res['machine'])}; {c['threads_per_rank']} thread(s)/rank",
        "",
        markdown_table(
            [
                "impl",
                "median step ms",
                "min ms",
                "p25 ms",
                "p75 ms",
                "steps",
                "buckets",
                "grad bytes/step",
            ],
            [
                [
                    "plait",
                    p["median_ms"],
                    p["min_ms"],
                    p["p25_ms"],
                    p["p75_ms"],
                    p["steps"],
                    p["buckets"],
                    p["grad_allreduce_bytes_per_step"],
                ],
                [
                    "DDP",
                    d["median_ms"],
                    d["min_ms"],
                    d["p25_ms"],
                    d["p75_ms"],
                    d["steps"],
                    _ddp_buckets(d),
                    _ddp_bytes(d),
                ],
            ],
        ),
        "",
        f"ratio plait/DDP (median step): **{ratio:.3f}** ({verdict} target <= {target}); "
        f"median of per-round ratios {res['paired_block_ratio']:.3f}; "
        f"max |loss diff| plait vs DDP {res['max_loss_diff']:.2e}",
        "",
        f"plait bucket launches in its last step: {_launches(p)}",
        "",
        "Median per-phase time on rank 0 (ms):",
        "",
        markdown_table(
            ["impl", *PHASES],
            [
                [n, *(s["phases_median_ms"][k] for k in PHASES)]
                for n, s in (("plait", p), ("DDP", d))
            ],
        ),
    ]
    return "\n".join(lines)


def _launches(p: dict) -> str:
    log = p["launch_log_last_step"]
    during = sum(1 for _, when in log if when == "backward")
    return f"{during} of {len(log)} during backward (overlapped), {len(log) - during} in finish()"


def _ddp_sizes(d: dict) -> list[int]:
    """DDP's bucket sizes in bytes from its logging data (rebuilt after the first step)."""
    sizes = d.get("rebuilt_bucket_sizes") or d.get("bucket_sizes") or ""
    return [int(x) for x in str(sizes).split(",") if x.strip()]


def _ddp_buckets(d: dict) -> int | str:
    return len(_ddp_sizes(d)) or "?"


def _ddp_bytes(d: dict) -> int | str:
    """DDP all-reduces each bucket once per synchronized step: the sum of bucket sizes."""
    return sum(_ddp_sizes(d)) or "?"


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
    res["command"] = "python " + " ".join(sys.argv)
    print(report(res, opts.target))
    save_json(opts.json, res)


if __name__ == "__main__":
    main()
