"""Naive data parallelism (one coordinator) next to plait's DDP-style data parallelism, with
torch's DistributedDataParallel as the peer.

Naive DP: rank 0 holds the optimizer, scatters the inputs, gathers the logits, computes the
loss, scatters their gradients back, takes the reduced gradients, steps alone and broadcasts
the parameters. DDP: every rank steps its own replica after one all-reduce of Ψ gradients.
torch DDP does the same with its own buckets and reducer: same model, data, batch and seed,
so its losses must match plait DP's.
"""

from __future__ import annotations

from pathlib import Path

from plait.lessons import figures
from plait.lessons.common import lesson_config, psi
from plait.lessons.peer import ddp_peer
from plait.lessons.readings import Records, bytes_by_op, losses, median_step_s, peak
from plait.lessons.section import Case, CaseRun, Row, Section

NAME = "dp"
TITLE = "Data parallelism: naive (one coordinator) vs plait DP vs torch DDP"
LOSS_RTOL = 1e-5  # fp32 parity (docs/exactness.md); same gradients, AdamW arithmetic as torch's
MODES = {"naive": "naive", "ddp": "plait DP", "torch-ddp": "torch DDP"}


def cases(quick: bool, procs: int) -> list[Case]:
    plait = [
        Case(mode, lesson_config(quick, {"dp": procs, "dp_mode": mode}, accum=2))
        for mode in ("naive", "ddp")
    ]
    return [*plait, Case("torch-ddp", plait[1].cfg, ddp_peer)]


def section(runs: dict[str, CaseRun], out: Path) -> Section:
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
    sec.rows += _peer_rows(results, n)
    sec.notes.append(
        "torch DDP (lessons/peer.py) runs as shipped: its gradient bytes are computed from its "
        "own bucket sizes (it all-reduces each bucket once per step; its reducer is not "
        "counted by plait's Comm), its loss all-reduce, loss, time and optimizer states are "
        "measured. It keeps its buckets beside the gradients (gradient_as_bucket_view=False, "
        "torch's default); plait DP's gradients live in its buckets."
    )
    ops = sorted(set(naive) | set(ddp))
    peer = _peer_bytes(results["torch-ddp"])
    sec.figures.append(figures.bars(
        out / "dp-bytes.png", ops, {"naive": [naive.get(o, 0) / 1e3 for o in ops],
                                    "plait DP": [ddp.get(o, 0) / 1e3 for o in ops],
                                    "torch DDP": [peer.get(o, 0) / 1e3 for o in ops]},
        f"bytes per step by collective (Ψ = {n:,})", "kB per rank"))  # fmt: skip
    kept = {"gradients": "grads", "optimizer_states": "Adam", "comm_buffers": "buffers"}
    groups = [f"{short} r{r}" for short in kept.values() for r in range(dp)]
    series = {MODES[mode]: [peak(results[mode], r, c) / 1e3 for c in kept for r in range(dp)]
              for mode in MODES}  # fmt: skip
    sec.figures.append(figures.bars(out / "dp-memory.png", groups, series,
                                    "memory per rank: rank 0 carries naive DP", "kB"))  # fmt: skip
    sec.figures.append(figures.lines(
        out / "dp-loss.png", {MODES[m]: losses(results[m]) for m in ("ddp", "torch-ddp")},
        "training loss per step: plait DP and torch DDP", "loss (nats/token)"))  # fmt: skip
    sec.raw = {"psi": n, "bytes": {"naive": naive, "ddp": ddp, "torch-ddp": peer},
               "median_step_s": {k: median_step_s(r) for k, r in results.items()},
               "losses": {k: losses(r) for k, r in results.items()},
               "ddp_buckets": results["torch-ddp"][0]["steps"][-1]["ddp_bucket_bytes"]}  # fmt: skip
    return sec


def _peer_bytes(records: Records) -> dict[str, int]:
    """torch DDP's bytes per step: its buckets (computed) and the loss (measured, Comm)."""
    got = bytes_by_op(records)
    buckets = sum(records[0]["steps"][-1]["ddp_bucket_bytes"])
    return got | {"all_reduce": got.get("all_reduce", 0) + buckets}


def _peer_rows(results: dict[str, Records], n: int) -> list[Row]:
    """torch DDP against plait DP: the same traffic and optimizer states, the same losses."""
    peer, plait = results["torch-ddp"], results["ddp"]
    ours, theirs = losses(plait), losses(peer)
    rel = [abs(a - b) / abs(b) for a, b in zip(theirs, ours, strict=True)]
    off = sum(r > LOSS_RTOL for r in rel)
    return [
        Row("torch DDP: all-reduce per step", "4Ψ (its buckets, computed) + 4 B loss", 4 * n + 4,
            _peer_bytes(peer).get("all_reduce", 0), exact=True),
        Row("torch DDP: optimizer states per rank", "8Ψ (Adam's moments)", 8 * n,
            peak(peer, 0, "optimizer_states"), exact=True),
        Row("torch DDP: bucket buffers besides the gradients", "4Ψ (a copy to reduce)", 4 * n,
            peak(peer, 0, "comm_buffers"), exact=True),
        Row("plait DP: bucket buffers besides the gradients", "0 (gradients live in them)", 0,
            peak(plait, 0, "comm_buffers"), exact=True),
        Row("torch DDP: loss at step 0 − plait DP's", "0 (same weights, batch, sums)", 0,
            abs(theirs[0] - ours[0]), unit="", exact=True),
        Row(f"torch DDP: steps whose loss is off plait DP's by > {LOSS_RTOL:g} (relative)",
            f"0 (largest: {max(rel):.1e})", 0, off, unit="", exact=True),
        Row("step time plait DP / torch DDP", "measured", None,
            median_step_s(plait) / median_step_s(peer), unit="x"),
    ]  # fmt: skip
