"""Which layers each pipeline stage runs: the pure split of a model into stages.

Pure arithmetic (no model, no process), so the command line checks a split before any worker
starts and the runtime (`parallel/pipeline/stage.py`) prunes the model to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plait.errors import ConfigError


@dataclass(frozen=True)
class StagePlan:
    """What one global stage computes."""

    stage: int
    layers: range
    first: bool
    last: bool


def split_layers(n_layers: int, num_stages: int, sizes: Sequence[int] | None = None) -> list[range]:
    """Contiguous layer ranges per stage: `sizes` if given, else as even as possible.

    Even split: the remainder goes to the middle stages first, because stage 0 also runs
    the embedding and the last stage the head and loss.
    """
    if num_stages > n_layers:
        raise ConfigError(
            f"more pipeline stages (pp x virtual stages = {num_stages}) than layers ({n_layers})"
        )
    if sizes is None:
        base, extra = divmod(n_layers, num_stages)
        order = [*range(1, num_stages - 1), 0, num_stages - 1]
        bonus = set(order[:extra])
        sizes = [base + (1 if s in bonus else 0) for s in range(num_stages)]
    if len(sizes) != num_stages or sum(sizes) != n_layers or min(sizes) < 1:
        raise ConfigError(
            f"stage layer counts {list(sizes)} must be {num_stages} numbers >= 1 summing to "
            f"{n_layers} layers"
        )
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def rank_plans(
    n_layers: int, p: int, v: int, rank: int, sizes: Sequence[int] | None = None
) -> list[StagePlan]:
    """The v stages pipeline rank `rank` runs, chunk c being global stage c*p + rank."""
    ranges = split_layers(n_layers, p * v, sizes)
    last = p * v - 1
    return [
        StagePlan(c * p + rank, ranges[c * p + rank], c * p + rank == 0, c * p + rank == last)
        for c in range(v)
    ]
