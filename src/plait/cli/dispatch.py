"""The `plait` parser and the dispatch to one module per command (see `plait.cli`)."""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Callable

from rich.console import Console

from plait.cli import (
    calibrate,
    checkpoint,
    data,
    estimate,
    evaluate,
    lessons,
    models,
    plan,
    presets,
    schedule,
    train,
)
from plait.domain import Parser, check_parsed
from plait.errors import ConfigError, print_bad_input

Handler = Callable[[argparse.Namespace, Console], int]

HANDLERS: dict[str, Handler] = {
    "train": train.run,
    "estimate": estimate.run,
    "eval": evaluate.run,
    "plan": plan.run,
    "calibrate": calibrate.run,
    "presets": presets.run,
    "schedule": schedule.run,
    "checkpoint": checkpoint.run,
    "tokenizer": data.run_data_command,
    "data": data.run_data_command,
    "export": models.run,
    "generate": models.run,
    "lessons": lessons.lessons_main,
}
"""Each command's handler: parsed arguments and the error console in, the exit code out."""

DESCRIPTION = (
    "plait: train transformer language models in any data, tensor and pipeline parallel "
    "layout, exact against one process"
)


def _version() -> str:
    try:
        return importlib.metadata.version("plait")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "unknown (not installed)"


def build_parser() -> Parser:
    parser = Parser(prog="plait", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"plait {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train.add_parser(sub)
    estimate.add_parser(sub)
    evaluate.add_parser(sub)
    plan.add_plan_parser(sub)
    calibrate.add_parser(sub)
    presets.add_parser(sub)
    schedule.add_parser(sub)
    checkpoint.add_parser(sub)
    data.add_data_commands(sub)
    models.add_model_commands(sub)
    lessons.add_lessons_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    err = Console(stderr=True, soft_wrap=True)  # one line per message, whatever the width
    try:
        check_parsed(parser, args)  # every numeric flag in its domain, before anything runs
    except ConfigError as e:
        return print_bad_input(err, e)
    return HANDLERS[args.command](args, err)
