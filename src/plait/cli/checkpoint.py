"""`plait checkpoint info` and `plait checkpoint consolidate`: parsing and printing; the
reading itself is `plait.checkpoint.inspect`."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from plait.checkpoint import inspect
from plait.errors import ConfigError, print_bad_input
from plait.outdir import check_out_file

PATH_HELP = "a checkpoint folder (OUT/checkpoints/step-N), or OUT to use its newest"


def add_parser(sub: argparse._SubParsersAction) -> None:
    ckpt = sub.add_parser("checkpoint", help="inspect a checkpoint, or write it as one file")
    actions = ckpt.add_subparsers(dest="action", required=True)
    info = actions.add_parser("info", help="step, saving layout, model, tensors and bytes")
    info.add_argument("path", help=PATH_HELP)
    whole = actions.add_parser(
        "consolidate", help="the full fp32 model, any saving layout, as one safetensors file"
    )
    whole.add_argument("path", help=PATH_HELP)
    whole.add_argument("--out", required=True, help="the .safetensors file to write")
    whole.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def run(args: argparse.Namespace, err: Console) -> int:
    try:
        if args.action == "info":
            facts = inspect.info(Path(args.path))
            table = Table(title=f"checkpoint {facts.pop('path')}")
            table.add_column("field")
            table.add_column("value")
            for key, value in facts.items():
                table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
            Console().print(table)
        else:
            check_out_file(Path(args.out), overwrite=args.overwrite)
            done = inspect.consolidate(Path(args.path), Path(args.out))
            Console().print(
                f"wrote {args.out}: {done['tensors']} tensors, {done['parameters']:,} "
                "fp32 parameters"
            )
    except ConfigError as e:
        return print_bad_input(err, e)
    return 0
