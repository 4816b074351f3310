"""Context parallelism composed, in a world of 4 (tests/context_parallel.py): cp2 x tp2 with
sequence parallelism (each cp rank's 16 tokens split again over tp), and dp2 x cp2 with
ZeRO-2 sharded over the four ranks of dp x cp, on packed rows, equal one process."""

from __future__ import annotations

import pytest

from context_parallel import cp_parity

CASES = {
    "cp2-tp2-sp-ring": dict(tp=2, sequence_parallel=True, preset="tiny-llama", exchange="ring"),
    "dp2-cp2-zero2": dict(dp=2, zero=2, micro=1, accum=2),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_composed_with_cp_give_the_single_process_loss(world4, case):
    out = world4.run(cp_parity, steps=4, **case)
    assert all(rank["losses"] == out[0]["losses"] for rank in out)
