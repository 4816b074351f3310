"""Exceptions plait raises on purpose, so callers can tell bad input from bugs."""

from __future__ import annotations


class ConfigError(ValueError):
    """Invalid user input, found before any worker starts.

    The message names the offending values; the CLI prints it and exits non-zero.
    """


class CommError(RuntimeError):
    """A collective or point-to-point call failed; the message names op, axis, ranks and step."""


class CommTimeoutError(CommError):
    """A collective or point-to-point call did not complete in time (op, axis and step named)."""
