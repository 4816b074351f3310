"""Partitioned activations: saved activations per rank vs the all-gather they cost (tp 2).

Under tensor parallelism every tp rank holds the same residual stream, so the input each
block keeps for its backward (full recomputation: the checkpoint; selective: the first
norm's input) is stored once per tp rank. ZeRO-R's partitioned activation checkpointing
(Rajbhandari et al., 2020; DeepSpeed's `partition_activations`, Megatron's
`distribute_saved_activations`) keeps 1/tp of it per rank and all-gathers the whole when
backward needs it: (1 - 1/t)·s·b·h·e bytes less per block, one all-gather of s·b·h·e bytes
more per block per micro-batch. `--partition-activations` does it; the gathered tensor is
the same, so the losses are equal bit for bit. Sequence parallelism already holds these
inputs sharded (and is refused with it).
"""

from __future__ import annotations

from pathlib import Path

from plait.estimate import estimate
from plait.estimate.partitioned import gathers_per_step
from plait.lessons import figures
from plait.lessons.common import lesson_config
from plait.lessons.readings import activations, bytes_by_op, losses, median_step_s
from plait.lessons.section import Case, CaseRun, Row, Section

NAME = "partition-activations"
TITLE = "Partitioned activations: saved activations per rank vs the all-gather they cost"
MODES = ("full", "selective")
CASES = {f"{m}{'+partition' if on else ''}": (m, on) for m in MODES for on in (False, True)}


def cases(quick: bool, procs: int) -> list[Case]:
    """tp 2 (dp takes the other processes), each recompute mode without and with."""
    par = {"tp": 2, "dp": procs // 2}
    return [
        Case(label, lesson_config(quick, par | {"recompute": mode, "partition_activations": on}))
        for label, (mode, on) in CASES.items()
    ]


def _gathered(run: CaseRun) -> int:
    """All-gather bytes of one step on the rank that gathered most."""
    return max(bytes_by_op(run.records, r).get("all_gather", 0) for r in range(len(run.records)))


def section(runs: dict[str, CaseRun], out: Path) -> Section:
    sec = Section(NAME, TITLE, __doc__.strip())
    ranks = range(len(runs["full"].records))
    held = {c: max(activations(runs[c].records, r) for r in ranks) for c in CASES}
    est = {c: estimate(runs[c].cfg).ranks[0].line("activations").device for c in CASES}
    gathered = {c: _gathered(runs[c]) for c in CASES}
    for c in CASES:
        sec.rows.append(Row(f"{c}: saved activations per rank (peak)", "plait estimate",
                            est[c], held[c]))  # fmt: skip
    for m in MODES:
        on = f"{m}+partition"
        sec.rows.append(Row(f"{m}: held less per rank with partitioning",
                            "L·(1 - 1/t)·sbh·e (plait estimate's difference)",
                            est[m] - est[on], held[m] - held[on], exact=True))  # fmt: skip
        sec.rows.append(Row(f"{m}: all-gather bytes added per step", "L·m·sbh·e",
                            gathers_per_step(runs[on].cfg)[1], gathered[on] - gathered[m],
                            exact=True))  # fmt: skip
        diff = max(abs(x - y) for x, y in zip(losses(runs[on].records), losses(runs[m].records),
                                              strict=True))  # fmt: skip
        sec.rows.append(Row(f"{on}: largest loss difference from {m}'s, every step",
                            "0 (bitwise equal)", 0.0, diff, unit="nats", exact=True))  # fmt: skip
    times = {c: median_step_s(runs[c].records) for c in CASES}
    for m in MODES:
        sec.rows.append(Row(f"step time {m}+partition / {m}", "measured (the all-gathers)",
                            None, times[f"{m}+partition"] / times[m], unit="x"))  # fmt: skip
    sec.notes += _notes(runs["full"], held, est)
    sec.figures.append(figures.points(
        out / "partition-activations.png",
        {c: (gathered[c] / 1e3, held[c] / 1e3) for c in CASES},
        "saved activations per rank vs all-gather bytes per step (tp 2)",
        "all-gather per step (kB)", "activations per rank (kB)",
        expected={c: (gathered[c] / 1e3, est[c] / 1e3) for c in CASES}))  # fmt: skip
    sec.raw = {"measured": held, "estimate": est, "all_gather_bytes": gathered,
               "median_step_s": times}  # fmt: skip
    return sec


def _notes(run: CaseRun, held: dict[str, int], est: dict[str, int]) -> list[str]:
    m, t = run.cfg.model, run.cfg.train
    gaps = ", ".join(f"{c} {held[c] - est[c]:+,} B" for c in CASES)
    return [
        f"Here L = {m.n_layers}, s = {t.seq_len}, b = {t.micro_batch}, h = {m.d_model}, "
        f"t = 2, e = 4 (fp32), m = {run.cfg.accumulation} micro-batch(es) a step. The "
        "estimate's own gap to the meter is the same with and without partitioning "
        f"({gaps}; the recompute lesson says what the estimator leaves out), so the "
        "difference partitioning makes is exact.",
        "The all-gathers are counted by plait's comm layer (logical bytes: the gathered "
        "tensor). On a GPU each is one more tp collective per block in backward, next to "
        "the all-reduces that block's backward (and, under full recomputation, its "
        "recomputed forward) already makes; on this shared CPU the step-time ratio is noise.",
    ]
