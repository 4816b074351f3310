"""Pipeline schedules side by side: naive model parallelism, GPipe, 1F1B, interleaved, ZB-H1.

One real step of each is traced (its Gantt chart below); its measured bubble stands next to
the published formula and to the simulator fed with the measured action costs. The simulated
bubbles with unit costs are deterministic and equal the formulas exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from plait.lessons import figures
from plait.lessons.common import lesson_config
from plait.lessons.section import Case, Row, Run, Section
from plait.parallel.pipeline.output.schedule_cli import formula, unit_costs
from plait.parallel.pipeline.plan.schedules import build_schedule
from plait.parallel.pipeline.plan.simulate import predicted_bubble, simulate

NAME = "pipeline"
TITLE = "Pipeline parallelism: naive MP vs GPipe vs 1F1B vs interleaved vs ZB-H1"
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")


def cases(quick: bool, procs: int) -> list[Case]:
    m = 4 if quick else 8
    return [
        Case(name, lesson_config(
            quick,
            {"pp": procs, "schedule": name, "virtual_stages": 2 if name == "interleaved" else 1},
            train={"trace": True}, model={"n_layers": 2 * procs}, micro=1, accum=m))
        for name in SCHEDULES
    ]  # fmt: skip


def section(runs: dict[str, Run], out: Path) -> Section:
    sec = Section(NAME, TITLE, __doc__.strip())
    in_flight: dict[str, tuple[int, ...]] = {}
    for name, run in runs.items():
        par = run.cfg.parallel
        sched = build_schedule(name, par.pp, run.cfg.accumulation, par.virtual_stages)
        costs = unit_costs(sched)
        sim = simulate(sched, costs)
        in_flight[name] = sim.peak_in_flight
        expected = predicted_bubble(sched, costs)
        measured = run.records[0]["pipeline"]
        sec.rows += [
            Row(f"{name}: simulated bubble, unit costs", formula(sched), float(expected),
                float(sim.bubble_fraction), unit="%", exact=True),
            Row(f"{name}: measured bubble vs formula", formula(sched), float(expected),
                measured["measured_bubble"], unit="%"),
            Row(f"{name}: measured bubble vs simulator on measured costs", "simulate()",
                measured["simulated_bubble"], measured["measured_bubble"], unit="%"),
        ]  # fmt: skip
        chart = f"pipeline-{name}-p{sched.p}-m{sched.m}-v{sched.v}.png"
        out.mkdir(parents=True, exist_ok=True)
        sec.figures.append(Path(shutil.copy(Path(run.cfg.train.out, chart), out / chart)))
    first = next(iter(runs.values())).cfg
    p, m = first.parallel.pp, first.accumulation
    for name, expected in (("naive", 1), ("gpipe", m), ("1f1b", min(p, m))):
        sec.rows.append(Row(f"{name}: micro-batches in flight on stage 0 (simulated)",
                            {"naive": "1", "gpipe": "m", "1f1b": "min(p, m)"}[name],
                            expected, in_flight[name][0], unit="", exact=True))  # fmt: skip
    sec.notes.append(
        "Measured bubbles on a tiny CPU model are far above the formulas: each action lasts "
        "about as long as the p2p message between stages, which the formulas (and the unit-"
        "cost simulator) count as free. The simulator fed with the measured action costs "
        "still leaves the messages out; the Gantt charts show where the time went."
    )
    stages = [f"stage {k}" for k in range(p)]
    sec.figures.append(figures.bars(
        out / "pipeline-in-flight.png", stages,
        {n: list(v) for n, v in in_flight.items()},
        "micro-batch activations held at once per stage (simulator)", "micro-batches"))  # fmt: skip
    sec.raw = {"in_flight_simulated": in_flight,
               "measured": {n: r.records[0]["pipeline"] for n, r in runs.items()}}  # fmt: skip
    return sec
