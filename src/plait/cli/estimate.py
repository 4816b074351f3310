"""`plait estimate`: every train flag, and memory per rank predicted (nothing starts)."""

from __future__ import annotations

import argparse

from rich.console import Console

from plait.cli.run_flags import add_run_flags, config_from_args
from plait.domain import above
from plait.errors import ConfigError, print_bad_input
from plait.estimate import estimate
from plait.estimate.table import print_estimate, print_json
from plait.plan.headroom import DEFAULT, HEADROOM, headroom_bytes


def add_parser(sub: argparse._SubParsersAction) -> None:
    est = sub.add_parser(
        "estimate", help="memory per rank of a run, predicted (nothing starts, nothing allocated)"
    )
    add_run_flags(est)
    est.add_argument("--json", action="store_true", help="print JSON only (exact bytes)")
    est.add_argument(
        "--device-memory", type=above(0), metavar="GIB", help="fail (exit 2) if a rank needs more"
    )
    est.add_argument(
        "--memory-headroom",
        type=HEADROOM,
        default=HEADROOM(DEFAULT),
        help=f"with --device-memory: memory a rank must leave free, a share (10%%) or a size "
        f"(6GiB); default {DEFAULT}, as plait plan (docs/planning.md)",
    )


def run(args: argparse.Namespace, err: Console) -> int:
    budget = args.device_memory
    try:
        cfg = config_from_args(args, check_data=False)
        memory = int(budget * 2**30) if budget is not None else 0
        kept = headroom_bytes(args.memory_headroom, memory) if budget is not None else 0
        est = estimate(cfg)
    except ConfigError as e:
        return print_bad_input(err, e)
    print_json(est) if args.json else print_estimate(est, Console())
    worst = est.most_loaded
    if budget is not None and worst.total() + kept > memory:
        biggest = max(worst.lines, key=lambda line: line.device)
        less = f" less --memory-headroom {kept / 2**30:,.2f} GiB" if kept else ""
        err.print(
            f"[bold red]plait: error:[/] nothing fits: pipeline stage {worst.pp_rank} needs "
            f"{worst.total() / 2**30:,.2f} GiB on the device, more than --device-memory "
            f"{budget:g} GiB{less} (largest term: {biggest.name} "
            f"{biggest.device / 2**30:,.2f} GiB)",
            highlight=False,
        )
        return 2
    return 0
