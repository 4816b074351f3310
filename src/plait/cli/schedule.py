"""`plait schedule`: simulate a schedule with unit costs, print bubble and memory, draw it.

No model runs: this is the cost model alone, to choose p, m, v and the schedule before a job.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from plait.domain import at_least
from plait.errors import ConfigError, print_bad_input
from plait.outdir import check_out_folder
from plait.schedule.simulate import Simulation
from plait.schedule.unit_costs import unit_simulation


def schedule_main(p: int, m: int, schedule: str, v: int, out: Path | None) -> dict[str, Any]:
    """Simulate and print (`plait.schedule.unit_costs`); returns the figures printed."""
    sim, result = unit_simulation(p, m, schedule, v, out)
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
    sched.add_argument("--pp", type=at_least(1), required=True, help="pipeline stages (ranks)")
    sched.add_argument(
        "--microbatches", type=at_least(1), required=True, help="micro-batches per step"
    )
    sched.add_argument(
        "--schedule", default="1f1b", help="naive, gpipe, 1f1b, interleaved, zb-h1, 2bw"
    )
    sched.add_argument("--virtual-stages", type=at_least(1), default=1, help="chunks per rank (v)")
    sched.add_argument("--out", default=None, help="folder for the PNG chart and trace JSON")


def run(args: argparse.Namespace, err: Console) -> int:
    out = Path(args.out) if args.out else None
    try:
        if out is not None:
            check_out_folder(out)
        schedule_main(args.pp, args.microbatches, args.schedule, args.virtual_stages, out)
    except ConfigError as e:
        return print_bad_input(err, e)
    return 0
