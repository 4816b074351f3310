"""Context parallelism (--cp) is exact: cp2 equals one process on packed rows whose
documents straddle the cut, and its exchange moves the bytes of the formula."""

from __future__ import annotations

from context_parallel import cp_parity


def test_cp2_equals_one_process(world2):
    out = world2.run(cp_parity)
    assert out[0]["losses"] == out[1]["losses"]
