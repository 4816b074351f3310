"""`plait estimate`: every train flag, and memory per rank predicted (nothing starts)."""

from __future__ import annotations

import argparse

from rich.console import Console

from plait.cli.run_flags import add_run_flags, config_from_args
from plait.domain import above
from plait.errors import ConfigError, print_bad_input
from plait.estimate import estimate
from plait.estimate.table import print_estimate, print_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    est = sub.add_parser(
        "estimate", help="memory per rank of a run, predicted (nothing starts, nothing allocated)"
    )
    add_run_flags(est)
    est.add_argument("--json", action="store_true", help="print JSON only (exact bytes)")
    est.add_argument(
        "--device-memory", type=above(0), metavar="GIB", help="fail (exit 2) if a rank needs more"
    )


def run(args: argparse.Namespace, err: Console) -> int:
    try:
        cfg = config_from_args(args, check_data=False)
        est = estimate(cfg)
    except ConfigError as e:
        return print_bad_input(err, e)
    print_json(est) if args.json else print_estimate(est, Console())
    budget = args.device_memory
    worst = est.most_loaded
    if budget is not None and worst.total() > budget * 2**30:
        biggest = max(worst.lines, key=lambda line: line.device)
        err.print(
            f"[bold red]plait: error:[/] nothing fits: pipeline stage {worst.pp_rank} needs "
            f"{worst.total() / 2**30:,.2f} GiB on the device, more than --device-memory "
            f"{budget:g} GiB (largest term: {biggest.name} {biggest.device / 2**30:,.2f} GiB)",
            highlight=False,
        )
        return 2
    return 0
