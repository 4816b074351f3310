"""`plait schedule`: simulate a schedule with unit costs, print bubble and memory, draw it.

No model runs: this is the cost model alone, to choose p, m, v and the schedule before a job.
"""

from __future__ import annotations

import argparse
from fractions import Fraction
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from plait.errors import ConfigError, print_bad_input
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


def schedule_main(p: int, m: int, schedule: str, v: int, out: Path | None) -> dict[str, Any]:
    """Simulate `schedule` on p ranks with m micro-batches (v chunks per rank), print the
    bubble next to the formula's prediction and per-rank memory, and write `<name>.png` and
    `<name>.trace.json` under `out` when given. Raises ConfigError on bad sizes."""
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
    _print(sim, result)
    return result


def _in_flight(chunks: int, v: int) -> str:
    """Interleaved ranks hold chunk activations, each 1/v of a stage's: show both."""
    return str(chunks) if v == 1 else f"{chunks} chunks = {chunks / v:g} stages"


def _print(sim: Simulation, result: dict[str, Any]) -> None:
    s = sim.schedule
    table = Table(title=f"plait schedule: {s.name} p={s.p} m={s.m} v={s.v}")
    for col in ("rank", "busy", "idle", "peak in-flight micro-batches", "weight versions"):
        table.add_column(col, justify="right")
    for r in range(s.p):
        table.add_row(
            str(r),
            f"{float(sim.busy[r]):g}",
            f"{float(sim.makespan - sim.busy[r]):g}",
            _in_flight(sim.peak_in_flight[r], s.v),
            str(sim.peak_weight_versions[r]),
        )
    console = Console()
    console.print(table)
    predicted = result["predicted_bubble_fraction"]
    console.print(f"makespan  {result['makespan']:g}  (1 = one stage's forward, backward 2)")
    console.print(f"bubble    {result['bubble_fraction']:.4f}  simulated")
    if predicted is not None:
        console.print(f"          {predicted:.4f}  predicted by {result['formula']}")
    for key in ("chart", "trace"):
        if result[key]:
            console.print(f"{key:<9} {result[key]}", highlight=False)


def add_parser(sub: argparse._SubParsersAction) -> None:
    sched = sub.add_parser(
        "schedule", help="simulate a pipeline schedule (no model): bubble, memory, chart"
    )
    sched.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    sched.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    sched.add_argument(
        "--schedule", default="1f1b", help="naive, gpipe, 1f1b, interleaved, zb-h1, 2bw"
    )
    sched.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (v)")
    sched.add_argument("--out", default=None, help="folder for the PNG chart and trace JSON")


def run(args: argparse.Namespace, err: Console) -> int:
    out = Path(args.out) if args.out else None
    try:
        schedule_main(args.pp, args.microbatches, args.schedule, args.virtual_stages, out)
    except ConfigError as e:
        return print_bad_input(err, e)
    return 0
