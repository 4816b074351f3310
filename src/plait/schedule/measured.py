"""The measured side of a pipeline run: trace, Gantt chart and bubble next to the simulator.

The runtime records when each action ran on every pp rank (`PipelineDriver.gather_timings`);
this module turns those timings into what a reader looks at: a Chrome trace, a Gantt chart,
the measured bubble, and the simulator's prediction from the measured mean action costs.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from plait.schedule.actions import Kind, Schedule, TimedAction
from plait.schedule.chart import gantt_chart, write_trace
from plait.schedule.simulate import Costs, measure, simulate


def report(schedule: Schedule, timings: list[TimedAction], out: Path) -> dict:
    """Measured bubble next to the simulator's prediction from the measured mean costs;
    writes the Chrome trace, the Gantt chart and a JSON summary under `out`."""
    p, m = schedule.p, schedule.m
    origin = min(t.start for t in timings)
    shifted = [TimedAction(t.rank, t.index, t.action, t.start - origin, t.end - origin)
               for t in timings]  # fmt: skip
    makespan, _, bubble = measure(shifted, p)
    costs = measured_costs(schedule, shifted)
    predicted = simulate(schedule, costs).bubble_fraction
    out.mkdir(parents=True, exist_ok=True)
    name = f"pipeline-{schedule.name}-p{p}-m{m}-v{schedule.v}"
    write_trace(shifted, out / f"{name}.trace.json")
    title = f"{name}: measured bubble {float(bubble):.1%}, simulated {float(predicted):.1%}"
    gantt_chart(shifted, out / f"{name}.png", title=title, time_unit="s")
    result = {
        "schedule": schedule.name,
        "makespan_s": float(makespan),
        "measured_bubble": float(bubble),
        "simulated_bubble": float(predicted),
        "mean_cost_s": {"f": costs.f, "b": costs.b, "w": costs.w},
    }
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    return result


def measured_costs(schedule: Schedule, timings: list[TimedAction]) -> Costs:
    """Mean F, B and W durations; without a split backward B ran both halves: split evenly."""

    def mean(kind: Kind) -> float:
        values = [t.duration for t in timings if t.action.kind is kind]
        return statistics.fmean(values) if values else 0.0

    f, b, w = mean(Kind.F), mean(Kind.B), mean(Kind.W)
    if not schedule.split_backward:
        b, w = b / 2, b / 2
    return Costs(f=f, b=b, w=w)
