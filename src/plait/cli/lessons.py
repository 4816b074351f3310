"""`plait lessons`: its flags and its run (the lessons themselves: `plait.lessons`)."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from rich.console import Console

from plait.errors import ConfigError, print_bad_input
from plait.launch import Interrupted, WorkerFailure
from plait.signals import exit_code


def add_lessons_command(sub: argparse._SubParsersAction) -> None:
    lessons = sub.add_parser(
        "lessons", help="run the course's comparisons on this machine: lessons.md, figures, JSON"
    )
    lessons.add_argument(
        "--only", action="append", metavar="NAME", help="run this lesson only (repeatable)"
    )
    lessons.add_argument("--out", default="lessons", help="folder for lessons.md and figures")
    lessons.add_argument("--quick", action="store_true", help="tiny models, few steps (~2 min)")


def lessons_main(args: argparse.Namespace, err: Console) -> int:
    from plait.lessons.runner import check_request, choose_procs, run_lessons

    out = Path(args.out)
    try:
        names = check_request(args.only, out)
    except ConfigError as e:
        return print_bad_input(err, e)
    say = lambda text: err.print(f"plait: {text}", markup=False, highlight=False)  # noqa: E731
    procs = choose_procs(os.cpu_count() or 1, say)
    try:
        run_lessons(names, args.quick, out, procs, err)
    except WorkerFailure as e:
        err.print("[bold red]plait: a worker failed; all ranks stopped.[/]")
        err.print(str(e), markup=False, highlight=False)
        return 1
    except (Interrupted, KeyboardInterrupt) as e:  # nothing of this request was written
        err.print("[bold]plait: lessons interrupted; every rank stopped.[/]")
        return exit_code(getattr(e, "signum", signal.SIGINT))
    Console().print(f"wrote {out / 'lessons.md'}, {out / 'lessons.json'} and the figures")
    return 0
