"""The exact loss where layouts compose (issue 21), in a world of 4: dp2 x tp2 with sequence
parallelism, and dp2 x pp2 in 1F1B and ZB-H1, on packed, masked rows (tests/exact_loss.py),
equal one process. dp2 x tp2 x pp2 needs a world of 8, too slow for the suite on this
machine's CPUs; each pair of its axes is checked here and in test_exact_loss.py."""

from __future__ import annotations

import pytest

from exact_loss import exact_parity


def _id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


CASES = [
    dict(dp=2, tp=2, sequence_parallel=True, preset="tiny-llama", micro=1, accum=2),
    dict(dp=2, pp=2, schedule="1f1b", micro=1, accum=2),
    dict(dp=2, pp=2, schedule="zb-h1", micro=1, accum=3, preset="tiny-llama", dropout=0.1),
]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_composed_layouts_give_the_single_process_loss(world4, case):
    out = world4.run(exact_parity, **case)
    assert all(losses == out[0] for losses in out)
