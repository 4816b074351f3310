"""The `plait` parser and the dispatch to one module per command (see `plait.cli`).

A command imports only its own module (and what that imports): `plait plan` never loads the
trainer, the launcher or the data pipeline. Only the whole parser (`plait --help`, an unknown
command, the tests' `build_parser()`) imports every command's module.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Callable, Sequence

from rich.console import Console

from plait.domain import Parser, check_parsed
from plait.errors import ConfigError, print_bad_input

Handler = Callable[[argparse.Namespace, Console], int]

COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("train", "add_parser", "run"),
    "estimate": ("estimate", "add_parser", "run"),
    "eval": ("evaluate", "add_parser", "run"),
    "plan": ("plan", "add_plan_parser", "run"),
    "calibrate": ("calibrate", "add_parser", "run"),
    "presets": ("presets", "add_parser", "run"),
    "schedule": ("schedule", "add_parser", "run"),
    "checkpoint": ("checkpoint", "add_parser", "run"),
    "tokenizer": ("data", "add_data_commands", "run_data_command"),
    "data": ("data", "add_data_commands", "run_data_command"),
    "export": ("models", "add_model_commands", "run"),
    "generate": ("models", "add_model_commands", "run"),
    "lessons": ("lessons", "add_lessons_command", "lessons_main"),
}
"""Each command: its module under plait.cli, the function adding its parser (a module's adds
all of its commands), its handler; in `plait --help`'s order."""


def _lazy(module: str, name: str) -> Handler:
    """The handler `name` of plait.cli.`module`, imported when the command runs."""

    def handler(args: argparse.Namespace, err: Console) -> int:
        return getattr(importlib.import_module(f"plait.cli.{module}"), name)(args, err)

    return handler


HANDLERS: dict[str, Handler] = {cmd: _lazy(m, h) for cmd, (m, _, h) in COMMANDS.items()}
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


def build_parser(commands: Sequence[str] | None = None) -> Parser:
    """The parser of `commands` (default: every command), importing only their modules."""
    parser = Parser(prog="plait", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"plait {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = COMMANDS if commands is None else commands
    adders = dict.fromkeys(COMMANDS[c][:2] for c in COMMANDS if c in wanted)
    for module, adder in adders:
        getattr(importlib.import_module(f"plait.cli.{module}"), adder)(sub)
    return parser


def _named(argv: Sequence[str]) -> list[str] | None:
    """The command `argv` names first, if it names one; otherwise None (the whole parser:
    `--help`, `--version`, a mistyped command listed against every command)."""
    return [argv[0]] if argv and argv[0] in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_named(argv))
    args = parser.parse_args(argv)
    err = Console(stderr=True, soft_wrap=True)  # one line per message, whatever the width
    try:
        check_parsed(parser, args)  # every numeric flag in its domain, before anything runs
    except ConfigError as e:
        return print_bad_input(err, e)
    return HANDLERS[args.command](args, err)
