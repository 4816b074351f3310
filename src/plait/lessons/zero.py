"""ZeRO stages 0-3 with mixed-precision Adam: model-state bytes per rank and step time.

Rajbhandari et al. (2020): 16-bit parameters and gradients (2Ψ + 2Ψ) and fp32 master weights,
momentum and variance (12Ψ) make 16Ψ per rank; stage 1 shards the 12Ψ (4Ψ + 12Ψ/N), stage 2
also the gradients (2Ψ + 14Ψ/N), stage 3 everything (16Ψ/N). Stage 3 pays for it with a
second all-gather of the parameters (for the backward): the stage-2 vs stage-3 trade-off.
"""

from __future__ import annotations

from pathlib import Path

from plait.estimate.formulas import zero_comm_elements, zero_model_state_bytes
from plait.lessons import figures
from plait.lessons.common import lesson_config, psi
from plait.lessons.readings import bytes_by_op, median_step_s, model_states
from plait.lessons.section import Case, CaseRun, Row, Section

NAME = "zero"
TITLE = "ZeRO 0/1/2/3: model states per rank vs 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N"
FORMULAS = ("16Ψ", "4Ψ + 12Ψ/N", "2Ψ + 14Ψ/N", "16Ψ/N")
STAGES = range(4)


def cases(quick: bool, procs: int) -> list[Case]:
    return [
        Case(f"zero{s}", lesson_config(quick, {"dp": procs, "zero": s, "precision": "bf16"}))
        for s in STAGES
    ]


def section(runs: dict[str, CaseRun], out: Path) -> Section:
    cfg = runs["zero0"].cfg
    n, dp = psi(cfg), cfg.parallel.dp
    sec = Section(NAME, TITLE, __doc__.strip())
    states, comm, times = [], [], []
    for s in STAGES:
        run = runs[f"zero{s}"]
        expected = zero_model_state_bytes(s, n, dp, param_bytes=2, grad_bytes=2, optim_bytes=12)
        measured = max(model_states(run.records, r) for r in range(dp))
        states.append((expected, measured))
        sec.rows.append(Row(f"stage {s}: model states per rank (largest)", FORMULAS[s],
                            expected, measured, exact=True))  # fmt: skip
        got = bytes_by_op(run.records)
        for op, elements in zero_comm_elements(s, n, cfg.accumulation).items():
            loss = 4 if op == "all_reduce" else 0  # the step's loss, fp32, as every layout
            sec.rows.append(Row(f"stage {s}: {op} per step",
                                f"{elements // n}Ψ x 2 B (bf16)" + (" + 4 B loss" if loss else ""),
                                2 * elements + loss, got.get(op, 0), exact=True))  # fmt: skip
        comm.append(got)
        times.append(median_step_s(run.records))
    for s in (1, 2, 3):
        sec.rows.append(Row(f"step time stage {s} / stage 0", "measured", None,
                            times[s] / times[0], unit="x"))  # fmt: skip
    sec.notes.append(
        "plait pads each flat group to a multiple of N; with Ψ divisible by N (as here) "
        "the padding is zero and the measured bytes equal the formulas exactly."
    )
    labels = [f"stage {s}" for s in STAGES]
    sec.figures.append(figures.bars(
        out / "zero-model-states.png", labels,
        {"formula": [e / 1e6 for e, _ in states], "measured": [m / 1e6 for _, m in states]},
        f"model states per rank, Ψ = {n:,}, N = {dp}", "MB"))  # fmt: skip
    sec.figures.append(figures.bars(
        out / "zero-step-time.png", labels, {"median step": [t * 1e3 for t in times]},
        "step time (median, first step left out)", "ms"))  # fmt: skip
    sec.raw = {"psi": n, "dp": dp, "model_states": states, "bytes": comm, "median_step_s": times}
    return sec
