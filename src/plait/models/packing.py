"""Packed rows: several examples in one row, each with its own positions and no cross-talk.

`segments` (b, s) int64 says which example each token belongs to: every example is one
contiguous run of equal ids, positions restart at 0 at each run, and a token attends only to
earlier tokens of its own run (block-causal), so a packed row computes exactly what its
examples compute one by one. Padding is a run of its own with IGNORE targets.

`Packing.of` turns segments into the per-token positions and the (b, 1, s, s) attention mask
once per forward (or pipeline stage call); every layer reads the same object. Runs are found
from changes of id, so the mask and the positions always agree. Segments None means plain
causal rows, and the model then runs exactly as without packing (SDPA with is_causal=True).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Packing:
    """Per-token positions (b, s) int64 and the block-causal mask (b, 1, s, s), True = sees."""

    positions: Tensor
    mask: Tensor

    @classmethod
    def of(cls, segments: Tensor | None) -> Packing | None:
        """From segment ids (b, s); None stays None (plain causal rows)."""
        if segments is None:
            return None
        if segments.dim() != 2:
            raise ValueError(f"segments must be (batch, seq), got shape {tuple(segments.shape)}")
        b, s = segments.shape
        change = torch.ones(b, s, dtype=torch.bool, device=segments.device)
        change[:, 1:] = segments[:, 1:] != segments[:, :-1]  # a run starts here
        index = torch.arange(s, device=segments.device).expand(b, s)
        starts = torch.where(change, index, torch.zeros_like(index)).cummax(dim=1).values
        runs = change.long().cumsum(dim=1)  # (b, s) run id per token
        causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
        mask = (runs.unsqueeze(-1) == runs.unsqueeze(-2)) & causal  # (b, s, s)
        return cls(positions=index - starts, mask=mask.unsqueeze(1))

    def rows(self, start: int, length: int) -> Tensor:
        """Positions of sequence slice [start, start + length) (a sequence-parallel shard)."""
        return self.positions[:, start : start + length]
