"""Exceptions plait raises on purpose, so callers can tell bad input from bugs."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape


class ConfigError(ValueError):
    """Invalid user input, found before any worker starts.

    The message names the offending values; the CLI prints it and exits non-zero.
    """


class CommError(RuntimeError):
    """A collective or point-to-point call failed; the message names op, axis, ranks and step."""


class CommTimeoutError(CommError):
    """A collective or point-to-point call did not complete in time (op, axis and step named)."""


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm is NaN or infinite (--nan-policy stop). Both values are
    global, so every rank raises it at the same step; the launcher reports it in one line."""


BAD_INPUT = 2
"""The exit code of bad input, the same for every command."""


def print_bad_input(console: Console, error: Exception) -> int:
    """The one line every command prints for bad input; returns its exit code."""
    console.print("[bold red]plait: error:[/] " + escape(str(error)), highlight=False)
    return BAD_INPUT
