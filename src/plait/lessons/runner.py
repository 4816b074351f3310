"""Run lessons: check the request, launch every case through plait's launcher (one world per
case, workers stopped with the launcher on Ctrl-C), build the sections, write the report.

Cases run in a temporary folder; what a reader keeps (figures, lessons.md, lessons.json) goes
to the output folder, merged with the lessons it already held (writeup.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from plait.errors import ConfigError
from plait.launch import launch
from plait.lessons import (
    context_parallel,
    dp,
    finetune,
    light_loss,
    lora,
    offload,
    offload_activations,
    partition_activations,
    pipeline,
    precision,
    qlora,
    recompute,
    tp,
    zero,
)
from plait.lessons.section import Case, CaseRun, Section
from plait.lessons.writeup import previous_sections, write_report
from plait.outdir import check_out_folder

MIN_PROCS, MAX_PROCS = 2, 4


def registry() -> dict[str, ModuleType]:
    """Lesson name -> module, in the course's order."""
    course = (dp, pipeline, tp, zero, precision, recompute, offload, offload_activations,
              partition_activations, finetune, lora, qlora, light_loss,
              context_parallel)  # fmt: skip
    return {m.NAME: m for m in course}


def plan_cases(lesson: ModuleType, quick: bool, procs: int, work: Path) -> list[Case]:
    """A lesson's cases; one whose `cases` takes `work` (finetune builds its instruction
    data) gets its own folder of the run's temporary folder for what it builds."""
    if "work" in inspect.signature(lesson.cases).parameters:
        return lesson.cases(quick, procs, work=work)
    return lesson.cases(quick, procs)


def check_request(only: Sequence[str] | None, out: Path) -> list[str]:
    """The lessons to run; ConfigError (before anything runs) on an unknown name, an output
    folder that cannot be written, or a lessons.json there that cannot be read to merge."""
    known = list(registry())
    names = list(only) if only else known
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown lesson {', '.join(unknown)}; known: {', '.join(known)}")
    check_out_folder(out)
    previous_sections(out)  # the lessons kept there must be readable before any lesson runs
    return names


def choose_procs(cores: int, say: Callable[[str], None]) -> int:
    """Processes per lesson: up to 4, no more than the cores, and at least the 2 a comparison
    needs (with fewer cores they share, and the lesson says so)."""
    procs = max(MIN_PROCS, min(MAX_PROCS, cores))
    if cores < MAX_PROCS:
        say(f"{cores} CPU cores: lessons run with {procs} processes instead of {MAX_PROCS}"
            + (" (sharing one core; timings are slower)" if cores < MIN_PROCS else ""))  # fmt: skip
    return procs


def run_case(case: Case, folder: Path) -> CaseRun:
    """One world: every rank trains the case and writes its record under `folder/label`."""
    out = folder / case.label
    cfg = dataclasses.replace(case.cfg, log=dataclasses.replace(case.cfg.log, out=str(out)))
    launch(cfg, target=case.target)
    ranks = cfg.parallel.layout.world_size
    return CaseRun(cfg, [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)])


def run_lessons(names: Sequence[str], quick: bool, out: Path, procs: int,
                console: Console) -> list[Section]:  # fmt: skip
    """Every case of every lesson, with a progress bar; writes the report and returns it."""
    lessons = registry()
    sections = []
    columns = (TextColumn("[bold]lessons"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn())  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="plait-lessons-") as tmp,
        Progress(*columns, console=console) as bar,
    ):
        plans = {n: plan_cases(lessons[n], quick, procs, Path(tmp, n, "work")) for n in names}
        task = bar.add_task("", total=sum(len(c) for c in plans.values()), info="")
        for name, cases in plans.items():
            runs = {}
            for case in cases:
                bar.update(task, info=f"{name}: {case.label}")
                runs[case.label] = run_case(case, Path(tmp, name))
                bar.advance(task)
            sections.append(lessons[name].section(runs, out))
    write_report(sections, out, quick, order=list(lessons))
    return sections
