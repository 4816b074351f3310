"""Every numeric flag of every command refuses NaN, inf, a negative and an out-of-range value:
one line naming the flag and the value, exit 2, and the command never runs.

The flags are read from the parser itself (`plait.domain.Parser` keeps each command's numeric
flags and refuses a numeric flag declared without a domain), so a new flag is in this table
the moment it exists. In-process and pure: no command's handler is called.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest

from plait.config import SECTIONS, Config, validate_config
from plait.domain import Domain, Parser, check_fields
from plait.errors import ConfigError

cli_main = importlib.import_module("plait.cli.dispatch")  # the parser and the handlers

BASE: dict[tuple[str, ...], list[str]] = {
    ("train",): [],
    ("estimate",): [],
    ("eval",): [],
    ("plan",): ["--gpus", "8", "--global-batch", "8", "--seq-len", "64"],
    ("calibrate",): [],
    ("schedule",): ["--pp", "2", "--microbatches", "4"],
    ("tokenizer", "train"): ["--vocab-size", "300", "--out", "t.json"],
    ("data", "prepare"): ["--out", "shards"],
    ("data", "instructions"): ["--out", "ins.jsonl"],
    ("export",): ["--checkpoint", "ckpt", "--out", "hf"],
    ("generate",): ["--prompt", "hello", "--init-from", "hf"],
}
"""The smallest valid command line of each command with numeric flags (its required flags)."""


def commands(parser: Parser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Parser]:
    """Every (sub)command of `parser` by its words, e.g. ('data', 'prepare')."""
    found = {path: parser} if path else {}
    for sub in parser.commands:
        for name, child in sub.choices.items():
            found.update(commands(child, (*path, name)))
    return found


def bad_values(domain: Domain) -> list[str]:
    """NaN, inf, -1 when it is outside, and the nearest value outside each end."""
    values = ["nan", "inf"]
    step = 1 if domain.kind is int else 0.5
    if domain.low is not None:
        values.append(str(domain.low if domain.low_open else domain.low - step))
    if domain.high is not None:
        values.append(str(domain.high if domain.high_open else domain.high + step))
    if domain.problem(domain(str(-1))) is not None:
        values.append("-1")
    return list(dict.fromkeys(values))


def cases() -> list[tuple[tuple[str, ...], str, str]]:
    found = []
    for path, parser in commands(cli_main.build_parser()).items():
        for action in parser.numeric:
            for value in bad_values(action.type):
                found.append((path, action.option_strings[0], value))
    return found


CASES = cases()


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace every command's handler by one that records that it ran."""
    ran: list[str] = []
    for name in list(cli_main.HANDLERS):
        monkeypatch.setitem(cli_main.HANDLERS, name, lambda a, e, n=name: ran.append(n) or 0)
    return ran


def test_every_command_with_numeric_flags_has_a_base_line() -> None:
    with_numbers = {p for p, parser in commands(cli_main.build_parser()).items() if parser.numeric}
    assert with_numbers == set(BASE)
    assert len(CASES) > 150


@pytest.mark.parametrize("path", sorted(BASE))
def test_the_base_line_runs(path: tuple[str, ...], launched: list[str]) -> None:
    assert cli_main.main([*path, *BASE[path]]) == 0
    assert launched == [path[0]]


@pytest.mark.parametrize(("path", "flag", "value"), CASES)
def test_out_of_domain_is_one_line_and_exit_2(
    path: tuple[str, ...], flag: str, value: str, launched: list[str], capsys
) -> None:
    code = cli_main.main([*path, *BASE[path], flag, value])
    err = capsys.readouterr().err
    assert code == 2
    assert launched == []
    assert err.count("\n") == 1, err
    assert err.startswith(f"plait: error: {flag} must be "), err
    assert f"got {value}" in err or f"got '{value}'" in err or f"got {float(value)}" in err, err


def test_a_numeric_flag_without_a_domain_cannot_be_declared() -> None:
    parser = Parser()
    with pytest.raises(TypeError, match="needs a Domain"):
        parser.add_argument("--n", type=int)
    with pytest.raises(TypeError, match="needs a Domain"):
        parser.add_argument_group("g").add_argument("--x", type=float)


NUMERIC_FIELDS = [
    (section, f)
    for section, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
    if any(kind in str(f.type) for kind in ("int", "float")) and "bool" not in str(f.type)
]


@pytest.mark.parametrize(("section", "f"), NUMERIC_FIELDS, ids=lambda x: getattr(x, "name", x))
def test_every_numeric_config_field_has_a_domain_checked_from_toml(section: str, f) -> None:
    """The same domains hold for a value from a TOML file (validate_config), named as TOML
    spells it."""
    domain = f.metadata.get("domain")
    assert isinstance(domain, Domain), f"{section}.{f.name} has no domain"
    for value in (math.nan, math.inf, -math.inf):
        cfg = Config()
        setattr(getattr(cfg, section), f.name, value)
        with pytest.raises(ConfigError, match=rf"{section}\.{f.name} must be"):
            validate_config(cfg)
    with pytest.raises(ConfigError, match=rf"^{section}\.{f.name} must be"):
        check_fields(section, dataclasses.replace(getattr(Config(), section), **{f.name: -1e30}))


def test_domain_words() -> None:
    assert Domain(float, 0, 1, high_open=True).describe() == "in [0, 1)"
    assert Domain(float, 0, low_open=True).describe() == "> 0"
    assert Domain(int, 1).problem(Domain(int, 1)("abc")) == "must be an integer >= 1"
    with pytest.raises(ConfigError, match=r"^--lr must be a finite number > 0, got nan$"):
        Domain(float, 0, low_open=True).check("--lr", math.nan)
