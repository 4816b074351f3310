"""`plait estimate`: every train flag, and memory per rank predicted (nothing starts)."""

from __future__ import annotations

import argparse

from rich.console import Console

from plait.cli.run_flags import add_run_flags, config_from_args
from plait.device import host_available_bytes
from plait.domain import above
from plait.errors import ConfigError, print_bad_input
from plait.estimate import Estimate, estimate
from plait.estimate.host import node_host_bytes
from plait.estimate.table import gib, print_estimate, print_json
from plait.plan.headroom import add_headroom_flag, headroom_bytes
from plait.topology import Layout


def add_parser(sub: argparse._SubParsersAction) -> None:
    est = sub.add_parser(
        "estimate", help="memory per rank of a run, predicted (nothing starts, nothing allocated)"
    )
    add_run_flags(est)
    est.add_argument("--json", action="store_true", help="print JSON only (exact bytes)")
    est.add_argument(
        "--device-memory", type=above(0), metavar="GIB", help="fail (exit 2) if a rank needs more"
    )
    add_headroom_flag(est, "with --device-memory: ")


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
    _say_host(cfg.parallel.layout, est, args.json, err)
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


def _say_host(layout: Layout, est: Estimate, quiet: bool, err: Console) -> None:
    """The host memory all ranks on one machine hold together (as `plait train` starts them
    there), and whether it exceeds what this host has available now: train refuses then."""
    world = layout.world_size
    need = node_host_bytes(est, layout, range(world))
    if not need:
        return
    available = host_available_bytes()
    if not quiet:
        Console().print(
            f"Host memory, {world} rank{'s' if world != 1 else ''} on one machine: "
            f"{gib(need)}; this host has {gib(available)} available.",
            highlight=False,
        )
    if need > available:
        err.print(
            f"[yellow]plait: warning:[/] the host total {gib(need)} exceeds the "
            f"{gib(available)} this host has available: plait train would refuse this run here",
            highlight=False,
            soft_wrap=True,
        )
