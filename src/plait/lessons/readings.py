"""Reading the per-rank records `measure` returns: medians, bytes, memory by category.

Timing is noisy on a shared machine: the median over steps, the first step left out (it pays
for warm-up). Bytes and model states are deterministic: the last step's, as every step's.
"""

from __future__ import annotations

import statistics
from typing import Any

Records = list[dict[str, Any]]
"""One record per rank, in rank order."""


def median_step_s(records: Records) -> float:
    """The median step time of the slowest rank (the step ends when every rank is done)."""
    return max(statistics.median([s["time_s"] for s in r["steps"][1:] or r["steps"]])
               for r in records)  # fmt: skip


def bytes_by_op(records: Records, rank: int = 0) -> dict[str, int]:
    return dict(records[rank]["steps"][-1]["bytes"])


def model_states(records: Records, rank: int, place: str = "device") -> int:
    return int(records[rank]["steps"][-1]["memory"]["model_states"][place])


def peak(records: Records, rank: int, category: str | None = None, place: str = "device") -> int:
    """The largest per-step peak of `category` (None: all categories together) on `rank`."""
    steps = records[rank]["steps"]
    if category is None:
        return max(int(s["memory"]["peak_total"][place]) for s in steps)
    return max(int(s["memory"]["peak"][place][category]) for s in steps)


def activations(records: Records, rank: int, place: str = "device") -> int:
    """The peak bytes saved for backward on `rank` (`place` host: what activation offload
    moved there), from the metered step (measure.py)."""
    key = "activations" if place == "device" else f"activations_{place}"
    return max(int(s.get(key, 0)) for s in records[rank]["steps"])


def losses(records: Records) -> list[float]:
    return [s["loss"] for s in records[0]["steps"]]
