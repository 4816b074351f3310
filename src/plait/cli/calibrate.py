"""`plait calibrate`: its flags; the measuring is `plait.calibrate`."""

from __future__ import annotations

import argparse

from rich.console import Console

from plait.calibrate import run_calibrate
from plait.domain import at_least
from plait.errors import ConfigError, print_bad_input


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine; write a hardware profile")
    p.add_argument("--ranks", type=at_least(1), default=4, help="gloo processes to measure with")
    p.add_argument("--out", default="hardware.toml", help="the hardware TOML to write")
    p.add_argument("--model", default="small-gpt", help="the model whose step sets 'achievable'")
    p.add_argument("--seq-len", type=at_least(1), default=128, help="tokens per sequence")
    p.add_argument(
        "--repeats", type=at_least(1), default=7, help="timed repeats per figure (median)"
    )


def run(args: argparse.Namespace, err: Console) -> int:
    try:
        return run_calibrate(args)
    except ConfigError as e:
        return print_bad_input(err, e)
