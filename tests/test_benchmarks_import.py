"""Every benchmark module imports: a rename in src/ that breaks `make bench` fails here,
not weeks later when someone runs a benchmark (bench_ckpt once imported a removed name)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py")))
def test_benchmark_module_imports(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module(name)
    assert module.__name__ == name
    sys.modules.pop(name, None)
