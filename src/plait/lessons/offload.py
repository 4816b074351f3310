"""Offload: ZeRO-2's optimizer states and master weights on the device or in host memory.

With mixed-precision Adam the 12Ψ of fp32 master weights and moments are the largest part of
the model states; offloading them leaves 2Ψ + 2Ψ/N (16-bit parameters and gradient shard)
on the device and moves 12Ψ/N to the host, which then runs the optimizer step. On a CPU-only
machine both places are the same memory, so the time shows the copies alone.
"""

from __future__ import annotations

from pathlib import Path

from plait.lessons import figures
from plait.lessons.common import lesson_config, psi
from plait.lessons.readings import median_step_s, model_states
from plait.lessons.section import Case, CaseRun, Row, Section

NAME = "offload"
TITLE = "Offload: device vs host memory vs step time (ZeRO-2, bf16)"
PLACES = ("none", "cpu")


def cases(quick: bool, procs: int) -> list[Case]:
    return [
        Case(f"offload-{o}",
             lesson_config(quick, {"dp": procs, "zero": 2, "precision": "bf16", "offload": o}))
        for o in PLACES
    ]  # fmt: skip


def section(runs: dict[str, CaseRun], out: Path) -> Section:
    cfg = runs["offload-none"].cfg
    n, dp = psi(cfg), cfg.parallel.dp
    sec = Section(NAME, TITLE, __doc__.strip())
    kept, moved = runs["offload-none"].records, runs["offload-cpu"].records
    sec.rows += [
        Row("no offload: device model states", "2Ψ + 14Ψ/N", 2 * n + 14 * n / dp,
            model_states(kept, 0), exact=True),
        Row("offload: device model states", "2Ψ + 2Ψ/N", 2 * n + 2 * n / dp,
            model_states(moved, 0), exact=True),
        Row("offload: host model states", "12Ψ/N", 12 * n / dp,
            model_states(moved, 0, "host"), exact=True),
        Row("step time offload / device", "measured", None,
            median_step_s(moved) / median_step_s(kept), unit="x"),
    ]  # fmt: skip
    places = ["device", "host"]
    series = {o: [model_states(runs[f"offload-{o}"].records, 0, p) / 1e6 for p in places]
              for o in PLACES}  # fmt: skip
    title = f"model states per rank by place, Ψ = {n:,}"
    sec.figures.append(figures.bars(out / "offload-memory.png", places, series, title, "MB"))
    sec.raw = {"psi": n, "dp": dp, "median_step_s": {o: median_step_s(runs[f"offload-{o}"]
                                                     .records) for o in PLACES}}  # fmt: skip
    return sec
