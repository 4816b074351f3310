"""Naive data parallelism (one coordinator) next to plait's DDP-style data parallelism.

Naive DP: rank 0 holds the optimizer, scatters the inputs, gathers the logits, computes the
loss, scatters their gradients back, takes the reduced gradients, steps alone and broadcasts
the parameters. DDP: every rank steps its own replica after one all-reduce of Ψ gradients.
"""

from __future__ import annotations

from pathlib import Path

from plait.lessons import figures
from plait.lessons.common import lesson_config, psi
from plait.lessons.records import bytes_by_op, median_step_s, peak
from plait.lessons.section import Case, Row, Run, Section

NAME = "dp"
TITLE = "Data parallelism: naive (one coordinator) vs plait DP"


def cases(quick: bool, procs: int) -> list[Case]:
    return [
        Case(mode, lesson_config(quick, {"dp": procs, "dp_mode": mode}, accum=2))
        for mode in ("naive", "ddp")
    ]


def section(runs: dict[str, Run], out: Path) -> Section:
    cfg = runs["naive"].cfg
    results = {k: r.records for k, r in runs.items()}
    n = psi(cfg)
    t, v, dp = cfg.train, cfg.model.vocab_size, cfg.parallel.dp
    rows_per_micro = t.micro_batch * dp
    logits = cfg.accumulation * rows_per_micro * t.seq_len * v * 4
    naive, ddp = bytes_by_op(results["naive"]), bytes_by_op(results["ddp"])
    sec = Section(NAME, TITLE, __doc__.strip())
    sec.rows += [
        Row("DDP all-reduce of the gradients", "4Ψ (fp32 Ψ, + 4 B the loss)", 4 * n + 4,
            ddp.get("all_reduce", 0), exact=True),
        Row("naive: gradients reduced to rank 0", "4Ψ", 4 * n, naive.get("reduce", 0),
            exact=True),
        Row("naive: parameters broadcast from rank 0", "4Ψ (+ 12 B: grad norm, loss)",
            4 * n + 12, naive.get("broadcast", 0), exact=True),
        Row("naive: logits gathered to rank 0", "k·b·dp·s·V·4", logits,
            naive.get("gather", 0), exact=True),
        Row("naive: optimizer states on rank 0", "8Ψ (Adam's moments)", 8 * n,
            peak(results["naive"], 0, "optimizer_states"), exact=True),
        Row("naive: optimizer states on rank 1", "0", 0,
            peak(results["naive"], 1, "optimizer_states"), exact=True),
        Row("step time naive / DDP", "> 1 (expected slower)", None,
            median_step_s(results["naive"]) / median_step_s(results["ddp"]), unit="x"),
    ]  # fmt: skip
    ops = sorted(set(naive) | set(ddp))
    sec.figures.append(figures.bars(
        out / "dp-bytes.png", ops, {"naive": [naive.get(o, 0) / 1e3 for o in ops],
                                    "DDP": [ddp.get(o, 0) / 1e3 for o in ops]},
        f"bytes per step by collective (Ψ = {n:,})", "kB per rank"))  # fmt: skip
    ranks = [f"rank {r}" for r in range(dp)]
    kept = ("optimizer_states", "comm_buffers")
    series = {f"{mode} {c}": [peak(results[mode], r, c) / 1e3 for r in range(dp)]
              for mode in ("naive", "ddp") for c in kept}  # fmt: skip
    sec.figures.append(figures.bars(out / "dp-memory.png", ranks, series,
                                    "memory per rank: rank 0 carries naive DP", "kB"))  # fmt: skip
    sec.raw = {"psi": n, "bytes": {"naive": naive, "ddp": ddp},
               "median_step_s": {k: median_step_s(r) for k, r in results.items()}}  # fmt: skip
    return sec
