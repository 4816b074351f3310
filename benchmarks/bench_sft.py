"""Instruction data: packed vs padded training throughput, and `plait data prepare` throughput.

    .venv/bin/python benchmarks/bench_sft.py --json benchmarks/results/sft.json

1. Writes a seeded Alpaca-like set (`sft_data.py` says the length distribution, and why it is
   synthetic) and trains a byte-level BPE on its text with `plait tokenizer train`.
2. `plait data prepare --format alpaca` on the records and, for reference, the text path on
   the same text (Stanford's prompt + output as one document per record), alternating,
   `--repeats` times: median wall time of the command, tokens/s and examples/s.
3. Two `Trainer`s (world of one, dp 1) on the prepared examples, one packed (`pack=True`:
   best-fit decreasing, block-causal) and one padded (`pack=False`: one example a row), same
   preset, seed (so the same initial weights), seq_len and global batch. Before any step, both
   score the same validation examples with those weights: the loss per target token must agree
   (packing changes the rows, not the loss). Then warm-up and `--rounds` rounds of a block of
   `--steps` steps of each, the order flipping every round. A step's target tokens come from
   the rows' `target_count` of the indices the trainer's sampler draws (a mirror sampler with
   the same seed), so target tokens per second is exact per block; the ratio packed/padded is
   the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Side, alternate, machine, median, summarize, usable_cores
from output import machine_line, markdown_table, publish
from plait.config import Config
from plait.data import GlobalBatchSampler
from plait.mesh import single_process_mesh
from plait.microbatch import MicroBatch
from plait.preflight import configure
from plait.step import evaluate_totals
from plait.train import Trainer
from sft_data import length_summary, prepare_throughput, train_tokenizer, write_set


class TrainerSide(Side):
    """One packing mode: its Trainer and a sampler that mirrors the trainer's draws."""

    def __init__(self, name: str, trainer: Trainer) -> None:
        super().__init__(name, phases=("targets",))
        self.trainer = trainer
        rows, t = trainer.corpus.train, trainer.cfg.train
        self.mirror = GlobalBatchSampler(len(rows), t.global_batch, t.seed)


def timed_step(side: TrainerSide) -> tuple[float, dict[str, Any]]:
    """One optimizer step's wall seconds; its target tokens (counted outside the clock)."""
    start = time.perf_counter()
    loss = side.trainer.train_step().loss
    elapsed = time.perf_counter() - start
    side.losses.append(loss)
    targets = side.trainer.corpus.train.target_count(side.mirror.next_batch())
    return elapsed, {"targets": targets}


def trainer_config(opts: argparse.Namespace, data: Path, pack: bool) -> Config:
    overrides = {
        "model": {"max_seq_len": opts.seq_len, "dropout": 0.0},
        "train": {
            "micro_batch": opts.micro_batch,
            "global_batch": opts.global_batch,
            "seq_len": opts.seq_len,
            "seed": opts.seed,
            "device": "cpu",
            "steps": 10_000,
        },
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        "log": {"progress": False},
        "data": {
            "path": str(data),
            "pack": pack,
            "long": "drop",
            "val_fraction": opts.val_fraction,
        },
    }
    cfg = configure(opts.model, overrides)
    cfg.validate()
    return cfg


def step0_loss(trainer: Trainer) -> dict[str, float]:
    """Summed target loss and target tokens of every validation row, initial weights."""
    val, b = trainer.corpus.val, trainer.cfg.train.micro_batch
    batches = []
    for idx in torch.arange(len(val)).split(b):
        x, y, seg = val.draw(idx)
        batches.append(MicroBatch(x, y, torch.zeros(len(idx), dtype=torch.int64), seg))
    loss_sum, targets = evaluate_totals(trainer.model, batches, trainer.comm, None)
    return {"loss_sum": loss_sum, "targets": targets, "per_target": loss_sum / max(targets, 1),
            "rows": len(val)}  # fmt: skip


def block_rates(side: Side, steps: int) -> list[float]:
    """Target tokens per second of each recorded block (its targets over its seconds)."""
    t, n = side.times, side.phases["targets"]
    return [sum(n[i : i + steps]) / sum(t[i : i + steps]) for i in range(0, len(t), steps)]


def side_figures(side: TrainerSide, steps: int) -> dict[str, Any]:
    rows, cfg = side.trainer.corpus.train, side.trainer.cfg
    counts = rows.counts()
    per_epoch = side.mirror.batches_per_epoch
    rates = block_rates(side, steps)
    step_s = median(side.times)
    return {
        **summarize(side.times),
        "rows_per_epoch": counts["rows"],
        "steps_per_epoch": per_epoch,
        "padding_share": 1.0 - counts["efficiency"],
        "target_tokens_per_epoch": counts["target_tokens"],
        "target_tokens_per_step": median(side.phases["targets"]),
        "target_tokens_per_s": median(rates),
        "block_rates": rates,
        "epoch_s_estimate": per_epoch * step_s,
        "losses": side.losses,
        "report": side.trainer.corpus.report,
        "tokens_per_step": cfg.train.global_batch * cfg.train.seq_len,
    }


def train_throughput(opts: argparse.Namespace, data: Path) -> dict[str, Any]:
    sides = [TrainerSide(name, Trainer(trainer_config(opts, data, pack), single_process_mesh()))
             for name, pack in (("packed", True), ("padded", False))]  # fmt: skip
    check = {s.name: step0_loss(s.trainer) for s in sides}
    packed, padded = sides
    alternate([(packed, padded)], timed_step, warmup=opts.warmup, rounds=opts.rounds,
              steps=opts.steps)  # fmt: skip
    figures = {s.name: side_figures(s, opts.steps) for s in sides}
    pairs = zip(figures["packed"]["block_rates"], figures["padded"]["block_rates"], strict=True)
    a, b = check["packed"]["per_target"], check["padded"]["per_target"]
    return {
        **figures,
        "step0": check,
        "step0_rel_diff": abs(a - b) / abs(b),
        "paired_rate_ratio": median([x / y for x, y in pairs]),
        "rate_ratio_of_medians": figures["packed"]["target_tokens_per_s"]
        / figures["padded"]["target_tokens_per_s"],
        "epoch_ratio": figures["padded"]["epoch_s_estimate"]
        / figures["packed"]["epoch_s_estimate"],
    }


def run(opts: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(opts.threads or usable_cores())
    root = Path(tempfile.mkdtemp(prefix="plait-bench-sft-"))
    try:
        alpaca, texts = write_set(root, opts.seed, opts.examples)
        tok = train_tokenizer(root, texts, opts.vocab_size)
        prep, folder = prepare_throughput(root, alpaca, texts, tok, opts.repeats)
        lengths = length_summary(folder)
        train = train_throughput(opts, folder) if opts.rounds else {}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    config = {**vars(opts), "threads": torch.get_num_threads()}
    return {"machine": machine(), "config": config, "prepare": prep, "lengths": lengths,
            "train": train}  # fmt: skip


def report(res: dict[str, Any]) -> str:
    c, p = res["config"], res["prepare"]
    prep_rows = [[f"`--format {k}`", v["median_s"], round(v["tokens/s"]), round(v["examples/s"]),
                  v["MB/s"]] for k, v in p.items()]  # fmt: skip
    len_rows = [[k, *(f"{x:.1f}" if isinstance(x, float) else x for x in v.values())]
                for k, v in res["lengths"].items()]  # fmt: skip
    out = [
        f"### instruction data: {c['examples']:,} synthetic Alpaca-like records, BPE "
        f"{c['vocab_size']:,}",
        "",
        machine_line(res, c["threads"], per_rank=False),
        "",
        markdown_table(["prepare", "median s", "tokens/s", "records/s", "MB/s"], prep_rows),
        "",
        markdown_table(["tokens", *next(iter(res["lengths"].values())).keys()], len_rows),
    ]
    t = res["train"]
    if not t:
        return "\n".join(out)
    keys = ("rows_per_epoch", "steps_per_epoch", "padding_share", "target_tokens_per_step",
            "median_ms", "target_tokens_per_s", "epoch_s_estimate")  # fmt: skip
    head = ["rows", "rows/epoch", "steps/epoch", "padding", "targets/step", "median step ms",
            "target tokens/s", "epoch s (est.)"]  # fmt: skip
    fmt = {"padding_share": "{:.1%}", "target_tokens_per_step": "{:,.0f}",
           "target_tokens_per_s": "{:,.0f}", "epoch_s_estimate": "{:,.0f}"}  # fmt: skip
    rows = [[k, *(fmt.get(f, "{}").format(t[k][f]) if f in fmt else t[k][f] for f in keys)]
            for k in ("packed", "padded")]  # fmt: skip
    s0 = t["step0"]
    out += [
        "",
        f"train: {c['model']}, dp 1, seq_len {c['seq_len']}, global batch {c['global_batch']} "
        f"(micro {c['micro_batch']}), {c['rounds']} rounds x {c['steps']} steps per side",
        "",
        markdown_table(head, rows),
        "",
        f"target tokens/s packed/padded: median of per-round ratios **"
        f"{t['paired_rate_ratio']:.2f}**, ratio of medians {t['rate_ratio_of_medians']:.2f}; "
        f"over an epoch (every row's targets at the median step): {t['epoch_ratio']:.2f}",
        f"step 0, same weights, {s0['packed']['targets']:,} validation target tokens "
        f"({s0['packed']['rows']} packed / {s0['padded']['rows']} padded rows): loss per "
        f"target token packed {s0['packed']['per_target']:.6f}, padded "
        f"{s0['padded']['per_target']:.6f}, relative difference {t['step0_rel_diff']:.1e}",
    ]
    return "\n".join(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=20_000, help="synthetic Alpaca records")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3, help="prepare runs per path")
    ap.add_argument("--model", default="small-llama", help="plait preset name")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--val-fraction", type=float, default=0.005)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = all cores")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="0: prepare only")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    opts = ap.parse_args(argv)
    if opts.examples < 2:
        ap.error(f"--examples must be at least 2 (got {opts.examples})")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    res = run(opts)
    publish(res, report(res), opts.json)


if __name__ == "__main__":
    main()
