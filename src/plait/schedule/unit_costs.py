"""A schedule under unit costs: the figures `plait schedule` prints and the lesson compares.

Forward 1 and backward 2 per stage make every schedule do the same work per micro-batch, so
their makespans and bubbles compare directly and match the published formulas (pure).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

from plait.schedule.actions import Schedule
from plait.schedule.chart import gantt_chart, write_trace
from plait.schedule.schedules import build_schedule
from plait.schedule.simulate import Costs, Simulation, predicted_bubble, simulate

US_PER_UNIT = 1000.0
"""Trace time scale: one unit (a stage's forward) is drawn as 1 ms."""


def unit_costs(schedule: Schedule) -> Costs:
    """Forward 1, backward 2 per stage (split 1 + 1 where B and W are separate), a chunk of an
    interleaved schedule 1/v of that: every schedule then does the same work per micro-batch."""
    unit = Fraction(1, schedule.v)
    return Costs(f=unit, b=unit, w=unit)


def formula(schedule: Schedule) -> str:
    """The published bubble formula under unit_costs, in the schedule's own terms."""
    if schedule.name == "naive":
        return "(p-1)/p"
    if schedule.name == "interleaved":
        return "(p-1)/(v·m+p-1)"
    if schedule.name == "zb-h1":
        return "(p-1)(T_F+T_B-T_W)/makespan = (p-1)/(3m+p-1)"
    if schedule.steps > 1:
        return "(p-1)/(steps·m+p-1)"
    return "(p-1)/(m+p-1)"


def unit_simulation(
    p: int, m: int, schedule: str, v: int, out: Path | None
) -> tuple[Simulation, dict[str, Any]]:
    """Simulate `schedule` on p ranks with m micro-batches (v chunks per rank) under unit
    costs: the simulation and its figures (bubble next to the formula's prediction, per-rank
    memory), with `<name>.png` and `<name>.trace.json` written under `out` when given.
    Raises ConfigError on bad sizes."""
    sched = build_schedule(schedule, p, m, v)
    costs = unit_costs(sched)
    sim = simulate(sched, costs)
    predicted = predicted_bubble(sched, costs)
    result: dict[str, Any] = {
        "schedule": schedule,
        "p": p,
        "m": m,
        "v": v,
        "steps": sched.steps,
        "makespan": float(sim.makespan),
        "bubble_fraction": float(sim.bubble_fraction),
        "predicted_bubble_fraction": None if predicted is None else float(predicted),
        "formula": formula(sched),
        "peak_in_flight": list(sim.peak_in_flight),
        "peak_in_flight_stages": [n / v for n in sim.peak_in_flight],
        "weight_versions": list(sim.peak_weight_versions),
        "chart": None,
        "trace": None,
    }
    if out is not None:
        stem = f"{schedule}-p{p}-m{m}" + (f"-v{v}" if v > 1 else "")
        title = f"{schedule} p={p} m={m} v={v}: bubble {float(sim.bubble_fraction):.1%}"
        unit = "time (1 = one stage's forward)"
        result["chart"] = str(
            gantt_chart(sim.timings, Path(out) / f"{stem}.png", title=title, time_unit=unit)
        )
        result["trace"] = str(
            write_trace(sim.timings, Path(out) / f"{stem}.trace.json", US_PER_UNIT)
        )
    return sim, result
