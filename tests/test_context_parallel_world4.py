"""Context parallelism composed, in a world of 4 (tests/context_parallel.py): cp2 x tp2 with
sequence parallelism (each cp rank's 16 tokens split again over tp; the all-gather of each
rank's heads), dp2 x cp2 with ZeRO-2 sharded over the four ranks of dp x cp (the ring), and
cp2 x pp2 in 1F1B (each stage's activations the rank's s/cp tokens), on packed rows, equal one
process."""

from __future__ import annotations

import pytest

from context_parallel import cp_parity

CASES = {
    "cp2-tp2-sp": dict(tp=2, sequence_parallel=True, preset="tiny-llama"),
    "dp2-cp2-zero2-ring": dict(dp=2, zero=2, micro=1, accum=2, exchange="ring"),
    "cp2-pp2-1f1b-zero1": dict(pp=2, schedule="1f1b", micro=1, accum=4, zero=1),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_composed_with_cp_give_the_single_process_loss(world4, case):
    out = world4.run(cp_parity, steps=4, **case)
    assert all(rank["losses"] == out[0]["losses"] for rank in out)
