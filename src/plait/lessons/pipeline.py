"""Pipeline schedules side by side: naive model parallelism, GPipe, 1F1B, interleaved, ZB-H1.

One real step of each is traced (its Gantt chart below); its measured bubble stands next to
the published formula and to the simulator fed with the measured action costs. The simulated
bubbles with unit costs are deterministic and equal the formulas exactly. Each stage also
measures the activations it holds at once: the micro-batches the schedule keeps in flight
(GPipe m, 1F1B min(p - k, m) on stage k, naive 1) times one micro-batch's, byte for byte.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from plait.estimate import estimate
from plait.lessons import figures
from plait.lessons.common import lesson_config
from plait.lessons.readings import activations
from plait.lessons.section import Case, CaseRun, Row, Section
from plait.schedule.schedules import build_schedule
from plait.schedule.simulate import predicted_bubble, simulate
from plait.schedule.unit_costs import formula, unit_costs

NAME = "pipeline"
TITLE = "Pipeline parallelism: naive MP vs GPipe vs 1F1B vs interleaved vs ZB-H1"
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")


def cases(quick: bool, procs: int) -> list[Case]:
    """Micro-batches of 2 samples: a single sample's token ids are a view of the s + 1 token
    window it shares with its targets, and the activation meter counts that whole storage
    (8 B per micro-batch that the estimator, counting s ids, does not)."""
    m = 4 if quick else 8
    return [
        Case(name, lesson_config(
            quick,
            {"pp": procs, "schedule": name, "virtual_stages": 2 if name == "interleaved" else 1},
            train={"trace": True}, model={"n_layers": 2 * procs}, micro=2, accum=m))
        for name in SCHEDULES
    ]  # fmt: skip


def section(runs: dict[str, CaseRun], out: Path) -> Section:
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
        sec.figures.append(Path(shutil.copy(Path(run.cfg.log.out, chart), out / chart)))
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
    held = _activation_rows(sec, runs, in_flight, out)
    sec.raw = {"in_flight_simulated": in_flight, "activations": held,
               "measured": {n: r.records[0]["pipeline"] for n, r in runs.items()}}  # fmt: skip
    return sec


def stage_activations(run: CaseRun) -> list[int]:
    """Measured peak of saved activations per pipeline stage (the largest of its ranks)."""
    by_stage: dict[int, int] = {}
    for r, rec in enumerate(run.records):
        k = rec["coord"]["pp"]
        by_stage[k] = max(by_stage.get(k, 0), activations(run.records, r))
    return [by_stage[k] for k in sorted(by_stage)]


def _activation_rows(sec: Section, runs: dict[str, CaseRun], in_flight: dict[str, tuple[int, ...]],
                     out: Path) -> dict[str, dict[str, list[int]]]:  # fmt: skip
    """Measured activations per stage: GPipe and 1F1B against the micro-batches in flight x
    what naive (one in flight) measured on that stage; every schedule's most loaded stage
    against the estimator. Returns measured and estimated bytes per schedule and stage."""
    measured = {n: stage_activations(r) for n, r in runs.items()}
    est = {n: [x.line("activations").device for x in estimate(r.cfg).ranks]
           for n, r in runs.items()}  # fmt: skip
    one = measured["naive"]
    for name in ("gpipe", "1f1b"):
        for k, (n, got) in enumerate(zip(in_flight[name], measured[name], strict=True)):
            sec.rows.append(Row(f"{name}: activations held on stage {k} (measured)",
                                f"{n} in flight x naive's (one micro-batch)", n * one[k], got,
                                exact=True))  # fmt: skip
    for name, got in measured.items():  # zb-h1: see the note below
        sec.rows.append(Row(f"{name}: activations of the most loaded stage vs estimate",
                            "plait estimate: in flight x chunk bytes", max(est[name]),
                            max(got), exact=name != "zb-h1"))  # fmt: skip
    sec.notes.append(
        "ZB-H1's split backward frees part of a micro-batch's graph at B (what only the "
        "input gradient needed) and the rest at W; the estimator holds all of it until W. "
        "Where a stage's peak falls while a W waits (the last stage), the estimate is above "
        "what is held; the first stage does not split (its input has no gradient)."
    )
    kb = {n: [v / 1e3 for v in vals] for n, vals in measured.items()}
    marks = {n: [v / 1e3 for v in vals] for n, vals in est.items()}
    stages = [f"stage {k}" for k in range(len(one))]
    sec.figures.append(figures.bars(
        out / "pipeline-activations.png", stages, kb,
        "saved activations per stage, measured (ticks: estimate)", "kB", marks=marks))  # fmt: skip
    return {"measured": measured, "estimate": est}
