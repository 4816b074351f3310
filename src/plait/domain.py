"""The domain of a numeric value (a flag or a config field): one rule, checked before any
worker starts.

A `Domain` is both argparse's `type=` for a numeric flag and the rule that checks it, so a
flag cannot be declared without its range. Its conversion never fails (a word where a number
belongs is kept as `Unparsed`), so every wrong number, `nan`, `inf` and `abc` alike, is
reported by `check_parsed` as one line naming the flag, and exit 2, instead of argparse's usage
text. Config fields carry their Domain in `metadata["domain"]` (`plait.config`), which the
generated flags and the TOML check both read.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from plait.errors import ConfigError


class Unparsed(str):
    """A flag's text that is not a number of its kind (reported by `Domain.check`)."""


@dataclass(frozen=True)
class Domain:
    """Finite numbers of `kind` (int or float) in [low, high], either end open or absent."""

    kind: type = float
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __call__(self, text: str) -> int | float | str:
        """argparse's conversion: a number of `kind`, or the text kept for `check` to name."""
        try:
            return self.kind(text)
        except ValueError:
            return Unparsed(text)

    def describe(self) -> str:
        """The range in words, e.g. '>= 1', '> 0', 'in [0, 1)'."""
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{self.low:g}, {self.high:g}{right}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return "finite"

    def problem(self, value: Any) -> str | None:
        """What is wrong with `value` ('must be ...'), or None when it is in the domain."""
        noun = "an integer" if self.kind is int else "a finite number"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"must be {noun} {self.describe()}"
        if self.kind is int and not isinstance(value, int):
            return f"must be {noun} {self.describe()}"
        if not math.isfinite(value):
            return f"must be a finite number {self.describe()}"
        low_bad = self.low is not None and (
            value < self.low or (self.low_open and value == self.low)
        )
        high_bad = self.high is not None and (
            value > self.high or (self.high_open and value == self.high)
        )
        return f"must be {self.describe()}" if low_bad or high_bad else None

    def check(self, name: str, value: Any) -> None:
        """Raise ConfigError naming `name` and `value` when `value` is outside the domain."""
        problem = self.problem(value)
        if problem is not None:
            shown = repr(str(value)) if isinstance(value, Unparsed) else value
            raise ConfigError(f"{name} {problem}, got {shown}")


AUTO = "auto"


@dataclass(frozen=True)
class OrAuto(Domain):
    """A number of the domain, or the word `auto` for a value the command derives before it
    builds the config (`--dp auto`: from the launcher's world); the config itself only ever
    holds the number."""

    def __call__(self, text: str) -> int | float | str:
        return AUTO if text == AUTO else super().__call__(text)

    def problem(self, value: Any) -> str | None:
        return None if value == AUTO else super().problem(value)


def at_least(low: float, kind: type = int) -> Domain:
    return Domain(kind, low)


def above(low: float, kind: type = float) -> Domain:
    return Domain(kind, low, low_open=True)


def fraction(low_open: bool = False, high_open: bool = True) -> Domain:
    """A share or a probability: [0, 1) unless said otherwise."""
    return Domain(float, 0.0, 1.0, low_open, high_open)


class Once(argparse.Action):
    """A flag that names one thing (`--data`): given twice it is refused, in one line, rather
    than the second silently replacing the first (a run reads one data source)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
        option_string: str | None = None,
    ) -> None:  # fmt: skip
        before = getattr(namespace, self.dest, None)
        if before is not None and before is not argparse.SUPPRESS:
            parser.error(
                f"{option_string} given twice ({before!r}, then {values!r}): a run reads one "
                "source; put the files in one folder, or prepare them together into one"
            )
        setattr(namespace, self.dest, values)


class Parser(argparse.ArgumentParser):
    """argparse's parser that keeps its numeric flags and subcommands, so `check_parsed` and
    the tests can walk every one; a plain `type=int`/`float` flag (no domain) is refused here,
    so a new numeric flag cannot escape the check. Subcommands are made of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.numeric: list[argparse.Action] = []
        self.commands: list[argparse.Action] = []

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        return self._note(super().add_argument(*args, **kwargs))

    def add_argument_group(self, *args: Any, **kwargs: Any) -> Any:
        return self._noting(super().add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, **kwargs: Any) -> Any:
        return self._noting(super().add_mutually_exclusive_group(**kwargs))

    def add_subparsers(self, **kwargs: Any) -> Any:
        sub = super().add_subparsers(**kwargs)
        self.commands.append(sub)
        return sub

    def error(self, message: str) -> Any:
        """argparse's own refusals (an unknown flag or choice, a required flag missing, two
        flags that exclude each other) in one line like every other bad input, exit 2: its
        usage text buried the reason under lines of flags. The help is one flag away."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _noting(self, group: Any) -> Any:
        plain = group.add_argument
        group.add_argument = lambda *a, **kw: self._note(plain(*a, **kw))
        return group

    def _note(self, action: argparse.Action) -> argparse.Action:
        if action.type in (int, float):
            raise TypeError(f"{action.option_strings}: a numeric flag needs a Domain as its type")
        if isinstance(action.type, Domain):
            self.numeric.append(action)
        return action


def check_parsed(parser: Parser, args: argparse.Namespace) -> None:
    """Check every numeric flag of the chosen (sub)command; raise ConfigError naming the first
    outside its domain. `plait.cli.dispatch` runs it before any command does anything."""
    for action in parser.numeric:
        value = getattr(args, action.dest, None)
        if value is not None and value is not argparse.SUPPRESS:
            action.type.check(action.option_strings[0], value)
    for sub in parser.commands:
        chosen = getattr(args, sub.dest, None)
        if chosen in sub.choices:
            check_parsed(sub.choices[chosen], args)


def check_fields(section: str, obj: Any) -> None:
    """Check each field of dataclass `obj` whose metadata names a Domain (None = unset);
    the error names `section.field`, as a TOML file spells it."""
    for f in dataclasses.fields(obj):
        domain = f.metadata.get("domain")
        value = getattr(obj, f.name)
        if domain is not None and value is not None:
            domain.check(f"{section}.{f.name}", value)
