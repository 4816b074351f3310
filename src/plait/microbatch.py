"""What a runner consumes: one micro-batch (`MicroBatch`), and a step's micro-batches drawn
from some source (`MicroBatches`).

A leaf below the engines: the runners under parallel/ take micro-batches without importing
the data package that makes them (`data/batches.py`'s `StepBatches` is the source every run
uses; tests/test_layering.py keeps parallel/ off plait.data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from plait.models.packing import Packing


@dataclass
class MicroBatch:
    """One micro-batch as every stage sees it (tokens used by stage 0, targets by the last)."""

    tokens: Tensor  # (b, s)
    targets: Tensor  # (b, s), IGNORE where a token is no target
    keys: Tensor  # (b,) dropout keys
    # (b, s) packed rows' example ids; None: plain causal; a context-parallel rank's
    # ContextPacking (context_batches.py), which the model takes as it is (models/packing.py)
    segments: Tensor | Packing | None = None
    denom: float | None = None  # the loss's divisor (models/loss.py); None: the mean
    # A whole micro-batch of naive DP under loss_average "micro-batch": each replica share's
    # divisor, in share order (the shares' divisors differ); None: `denom` for every row.
    share_denoms: tuple[float, ...] | None = None


class MicroBatches(Protocol):
    """A step's micro-batches for this replica (`data.batches.StepBatches`)."""

    def draw(self, step: int) -> list[MicroBatch]:
        """Step `step`'s micro-batches of this replica's share."""
        ...

    def draw_whole(self, step: int) -> list[MicroBatch]:
        """Step `step`'s micro-batches of the whole global batch (naive data parallelism)."""
        ...
