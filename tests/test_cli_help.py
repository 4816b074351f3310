"""Every command's `--help` renders: argparse formats help strings with `%`, so a bare `%`
in one (a share such as "10%") crashes that command's help and nothing else notices."""

from __future__ import annotations

import argparse

from plait.cli import build_parser


def _parsers(
    parser: argparse.ArgumentParser, name: str
) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                found += _parsers(child, f"{name} {sub}")
    return found


def test_every_command_help_renders() -> None:
    parsers = _parsers(build_parser(), "plait")
    assert len(parsers) > 15  # the walk reached the nested commands (checkpoint info, data ...)
    for name, parser in parsers:
        assert "usage:" in parser.format_help(), name


def test_headroom_help_names_its_default() -> None:
    parsers = dict(_parsers(build_parser(), "plait"))
    for name in ("plait plan", "plait estimate"):
        assert "default 10%" in " ".join(parsers[name].format_help().split()), name
