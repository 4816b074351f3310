"""The bad-input sweep (benchmarks/bad_input_sweep.py): its table covers every command and
every class with at least 150 cases, and a slice of it (one case of each class for each
command, two signals) gives one line and the expected exit code, reaching no worker and
leaving nothing behind. The whole sweep is a script (docs/running.md has its counts)."""

from __future__ import annotations

import importlib
import sys
from collections import defaultdict
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def sweep():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("bad_input_sweep")
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("bad_input_sweep", None)


def test_the_table_covers_every_command_and_class(sweep):
    cases = sweep.all_cases()
    assert len(cases) >= 150
    assert len(set(cases)) == len(cases)  # no case counted twice
    commands = {c.command for c in cases}
    assert commands == {
        "train", "estimate", "plan", "calibrate", "schedule", "presets", "checkpoint info",
        "checkpoint consolidate", "export", "generate", "data prepare", "data instructions",
        "tokenizer train", "lessons", "eval",
    }  # fmt: skip
    assert {c.cls for c in cases} == set(sweep.CLASSES)
    for c in cases:
        assert c.code == (2 if c.cls != "signals" else c.code)
        assert c.code in (2, 130, 143)
    signals = {(c.command, c.code) for c in cases if c.cls == "signals"}
    assert signals == {(name, code) for name in commands for code in (130, 143)}


def _slice(cases):
    """The first case of each (class, command), and two signals."""
    first = {}
    for c in cases:
        if c.cls != "signals":
            first.setdefault((c.cls, c.command), c)
    picked = list(first.values())
    signals = [c for c in cases if c.cls == "signals"]
    return [*picked, signals[0], signals[-1]]


def test_a_slice_gives_one_line_and_exit_2_before_any_worker(sweep, tmp_path):
    cases = _slice(sweep.all_cases())
    root = sweep.scratch(tmp_path / "S")
    results = sweep.run(cases, root)
    bad = defaultdict(list)
    for r in results:
        if not r.ok:
            bad[r.why()].append(" ".join(r.case.argv))
    assert not bad, dict(bad)
    assert len(results) >= 40
    assert all(r.lines[0].startswith("plait") for r in results)


def test_the_sweep_catches_what_it_must(sweep, tmp_path):
    """A case that reaches the workers, writes a file or exits 0 is counted as not OK."""
    root = sweep.scratch(tmp_path / "S", trained=False)
    fine = sweep.Case("wrong value", ("schedule", "--pp", "2", "--microbatches", "4", "--out",
                                      "{S}/chart"))  # fmt: skip
    (result,) = sweep.run([fine], root)
    assert not result.ok and result.code == 0 and result.left  # it wrote its chart
    assert not (root / "chart").exists()  # and the sweep removed it
    run = sweep.Case("wrong value", ("train", *sweep.TINY, "--data", "{S}/text.txt", "--out",
                                     "{S}/r"))  # fmt: skip
    (result,) = sweep.run([run], root)
    assert result.reached and result.why() == "reached the workers"
