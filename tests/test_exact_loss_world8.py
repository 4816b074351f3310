"""The exact loss with every axis at once (issue 21): dp2 x tp2 (sequence parallel) x pp2 in
1F1B on packed, masked rows (tests/exact_loss.py) equals one process. One world of 8, started
once for this module (about 10 s here)."""

from __future__ import annotations

import pytest

from exact_loss import exact_parity
from harness import World


@pytest.fixture(scope="module")
def world8():
    w = World(8)
    yield w
    w.close()


def test_dp2_tp2_pp2_gives_the_single_process_loss(world8):
    case = dict(dp=2, tp=2, pp=2, sequence_parallel=True, schedule="1f1b", micro=1, accum=2)
    out = world8.run(exact_parity, **case, timeout=300)
    assert all(losses == out[0] for losses in out)
    assert 0.0 in out[0], "a global batch without targets: loss 0, not NaN"
