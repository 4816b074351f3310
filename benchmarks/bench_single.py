"""Single-process plait vs a plain PyTorch loop: what does plait's machinery cost on one rank?

Both sides train the same model (same preset and seed, so the same initial weights) on the
same batches with the same AdamW update rule and gradient clipping.

- `--plait dp` (default): plait's step protocol with the ZeRO engine at stage 0 (plain data
  parallelism) over a world of one (gradients land in flat buckets through per-parameter
  hooks; the all-reduce is a no-op), the global norm of `plait.parallel.grads`, the engine's
  element-wise AdamW and `zero_grad()`.
- `--plait trainer`: `plait.train.Trainer.train_step()` as a run executes it (sampler,
  dropout keys, lr schedule, the engine, clipping, loss reduction). The plain loop then
  does the same data work (same sampler, windows and lr schedule) by hand.

The plain loop is model -> loss.backward() -> torch.nn.utils.clip_grad_norm_ ->
optimizer.step() -> optimizer.zero_grad(). After warm-up, rounds alternate a block of K
steps of each side (the order flips every round); the report gives the median step time of
each and their ratio (target: plait overhead <= 5%).

    .venv/bin/python benchmarks/bench_single.py --rounds 40 --steps 5 --json out.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Side,
    alternate,
    loss_diffs,
    machine,
    pair_ratios,
    summarize,
    synthetic_batches,
    usable_cores,
)
from output import TIME_COLUMNS, machine_line, markdown_table, publish, ratio_line, time_cells
from plait.build.corpus import corpus_from_tokens
from plait.build.model import build_model
from plait.comm import Comm
from plait.config import Config, OptimConfig, build_config
from plait.data import GlobalBatchSampler, load_tokens, split_micro
from plait.mesh import single_process_mesh
from plait.models.presets import get_preset
from plait.optim import build_optimizer, lr_at, set_lr
from plait.parallel.adamw import AdamW
from plait.parallel.grads import SplitGradRules, clip_coef
from plait.parallel.zero.engine import ZeroEngine
from plait.parallel.zero.options import ZeroOptions
from plait.train import Trainer


class FnSide(Side):
    """A side whose whole step (data, model, update) is one callable returning the loss."""

    def __init__(self, name: str, step: Callable[[], float]) -> None:
        super().__init__(name)
        self.step = step


def timed_step(side: FnSide) -> tuple[float, dict]:
    """Wall seconds of one step (one process: no max over ranks); the loss is kept."""
    start = time.perf_counter()
    loss = side.step()
    elapsed = time.perf_counter() - start
    side.losses.append(loss)
    return elapsed, {}


def plain_step_fn(model, opt, clip: float, next_micro: Callable[[], list]) -> Callable[[], float]:
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> float:
        micro = next_micro()
        n, loss_sum = len(micro), 0.0
        for x, y in micro:
            loss = model(x, y)
            (loss / n).backward()
            loss_sum += float(loss.detach())
        if clip > 0:  # clip 0 = off (torch's clip_grad_norm_ with 0 would zero the grads)
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss_sum / n

    return step


def plait_dp_step_fn(model, opts, train_cfg, next_micro) -> tuple[Callable[[], float], object]:
    comm = Comm(single_process_mesh())
    options = ZeroOptions(stage=0, bucket_mb=opts.bucket_mb)
    dp = ZeroEngine(model, comm, AdamW.from_optim(train_cfg), options)
    rules = SplitGradRules.of(model, comm.mesh)
    counter = [0]

    def step() -> float:
        comm.stats.begin_step(counter[0])
        micro = next_micro()
        n, loss_sum = len(micro), 0.0
        for i, (x, y) in enumerate(micro):
            dp.micro_batch(is_last=i == n - 1)
            loss = model(x, y)
            (loss / n).backward()
            loss_sum += float(loss.detach())
        dp.finish()
        if opts.clip > 0:
            dp.clip(clip_coef(dp.grad_norm(rules), opts.clip))
        dp.step(train_cfg.lr)
        dp.zero_grad()
        counter[0] += 1
        return loss_sum / n

    return step, dp


def cycler(batches: list) -> Callable[[], list]:
    state = [0]

    def nxt() -> list:
        b = batches[state[0] % len(batches)]
        state[0] += 1
        return b

    return nxt


def fixed_batches(opts: argparse.Namespace, vocab: int) -> list:
    b, s, n = opts.micro_batch, opts.seq_len, opts.pool * opts.accum
    if opts.data == "synthetic":
        micro = synthetic_batches(opts.seed, n, b, s, vocab)
    else:
        from plait.data import TokenWindows

        windows = TokenWindows(load_tokens(opts.data_path, opts.max_bytes), s)
        g = torch.Generator().manual_seed(opts.seed)
        order = torch.randperm(len(windows), generator=g)[: n * b].view(n, b)
        micro = [windows.batch(order[i]) for i in range(n)]
    return [micro[i * opts.accum : (i + 1) * opts.accum] for i in range(opts.pool)]


def build_sides(opts: argparse.Namespace) -> tuple[FnSide, FnSide, dict]:
    device = torch.device("cpu")
    extra: dict = {}
    if opts.plait == "dp":
        cfg = get_preset(opts.model)
        train_cfg = OptimConfig(lr=opts.lr)
        batches = fixed_batches(opts, cfg.vocab_size)
        model_p = build_model(cfg, device, opts.seed)
        step_p, dp = plait_dp_step_fn(model_p, opts, train_cfg, cycler(batches))
        model_q = build_model(cfg, device, opts.seed)
        opt_q = build_optimizer(model_q, train_cfg)
        step_q = plain_step_fn(model_q, opt_q, opts.clip, cycler(batches))
        extra["buckets"] = len(dp.groups)
    else:
        full = trainer_config(opts)
        corpus = corpus_from_tokens(load_tokens(opts.data_path, opts.max_bytes), full)
        trainer = Trainer(full, single_process_mesh(device), corpus)
        extra["buckets"] = len(trainer.engine.groups)

        def step_p() -> float:
            return trainer.train_step().loss

        model_q = build_model(full.model, device, full.train.seed)
        opt_q = build_optimizer(model_q, full.optim)
        sampler = GlobalBatchSampler(len(corpus.train), full.train.global_batch, full.train.seed)
        counter = [0]

        def next_micro() -> list:
            set_lr(opt_q, lr_at(counter[0], full.optim, full.train.steps))
            counter[0] += 1
            idx = split_micro(sampler.next_batch(), full.train.micro_batch)
            return [corpus.train.batch(i) for i in idx]

        step_q = plain_step_fn(model_q, opt_q, full.optim.grad_clip, next_micro)
    return FnSide("plait", step_p), FnSide("plain", step_q), extra


def trainer_config(opts: argparse.Namespace) -> Config:
    overrides = {
        "train": {
            "micro_batch": opts.micro_batch,
            "global_batch": opts.micro_batch * opts.accum,
            "seq_len": opts.seq_len,
            "seed": opts.seed,
            "device": "cpu",
            "steps": 10_000,
        },
        "optim": {"lr": opts.lr, "min_lr": opts.lr / 10, "grad_clip": opts.clip},
        "log": {"progress": False},
        "parallel": {"bucket_mb": opts.bucket_mb},
        "data": {"path": opts.data_path, "max_bytes": opts.max_bytes},
    }
    cfg = build_config(opts.model, overrides)
    cfg.validate()
    return cfg


def run(opts: argparse.Namespace) -> dict:
    torch.set_num_threads(opts.threads or usable_cores())
    plait_side, plain_side, extra = build_sides(opts)
    alternate(
        [(plait_side, plain_side)],
        timed_step,
        warmup=opts.warmup,
        rounds=opts.rounds,
        steps=opts.steps,
    )
    return {
        "machine": machine(),
        "config": {**vars(opts), "threads": torch.get_num_threads()},
        "plait": {**summarize(plait_side.times), **extra, "times_ms": plait_side.times_ms()},
        "plain": {**summarize(plain_side.times), "times_ms": plain_side.times_ms()},
        **pair_ratios(plait_side, plain_side, per_block=True),
        "max_loss_diff": max(loss_diffs(plait_side, plain_side)),
    }


def report(res: dict, target: float) -> str:
    """The markdown printed at the end of a run (the JSON holds everything else)."""
    p, q, c = res["plait"], res["plain"], res["config"]
    what = "ZeRO engine stage 0 (world of 1)" if c["plait"] == "dp" else "Trainer.train_step"
    data = c["data"] if c["plait"] == "dp" else "real"
    rows = [[f"plait ({c['plait']})", *time_cells(p)], ["plain PyTorch", *time_cells(q)]]
    return "\n".join(
        [
            f"### single process: plait {what} vs plain PyTorch loop: {c['model']}, "
            f"micro-batch {c['micro_batch']} x seq {c['seq_len']} x accum {c['accum']}, "
            f"{data} data",
            "",
            machine_line(res, c["threads"], per_rank=False),
            "",
            markdown_table(["impl", *TIME_COLUMNS], rows),
            "",
            ratio_line(res, "plain", target) + f"; max |loss diff| {res['max_loss_diff']:.2e}",
        ]
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plait", choices=("dp", "trainer"), default="dp", help="plait side")
    ap.add_argument("--model", default="small-gpt", help="plait preset name")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument(
        "--data",
        choices=("synthetic", "real"),
        default="synthetic",
        help="dp mode only; trainer mode always reads the corpus",
    )
    ap.add_argument("--data-path", default=None)
    ap.add_argument("--max-bytes", type=int, default=2_000_000)
    ap.add_argument("--pool", type=int, default=8, help="distinct batches cycled (dp mode)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = all cores")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=1.05)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    res = run(opts)
    publish(res, report(res, opts.target), opts.json)


if __name__ == "__main__":
    main()
