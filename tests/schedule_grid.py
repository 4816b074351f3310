"""The grid of pipeline sizes that test_schedules and test_pipeline_simulate walk (no tests
here)."""

from __future__ import annotations

from collections.abc import Iterator


def grid(name: str) -> Iterator[tuple[int, int, int]]:
    """(p, m, v) for the validator grid: p 1..5, m p..3p; interleaved p >= 2, m | p, v 2..3."""
    for p in range(1, 6):
        for m in range(p, 3 * p + 1):
            if name != "interleaved":
                yield p, m, 1
            elif p >= 2 and m % p == 0:
                yield from ((p, m, v) for v in (2, 3))
