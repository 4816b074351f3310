"""ZeRO-2 and ZeRO-3 through a pipeline with every axis at once: dp2 x pp2 x tp2 (sequence
parallel) equals one process (fp32, rtol 1e-5, bytes by the formula of
tests/test_zero_pipelines.py). One world of 8, started once for this module."""

from __future__ import annotations

import pytest

from harness import World
from test_zero_pipelines import _parity


@pytest.fixture(scope="module")
def world8():
    w = World(8)
    yield w
    w.close()


CASES = [
    dict(zero=3, reshard="default", schedule="1f1b", preset="tiny-gpt", accum=2),
    dict(zero=2, reshard="default", schedule="zb-h1", preset="tiny-llama", accum=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"zero{c['zero']}-{c['schedule']}")
def test_dp2_pp2_tp2_equal_one_process(world8, case):
    out = world8.run(
        _parity, dp=2, pp=2, tp=2, sequence_parallel=True, steps=3, **case, timeout=300
    )
    assert len({o["loss"] for o in out}) == 1
    for rank in out:
        assert rank["counted"] == rank["expected"], rank
