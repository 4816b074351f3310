"""Packed rows: several examples in one row, each with its own positions and no cross-talk.

`segments` (b, s) int64 says which example each token belongs to: every example is one
contiguous run of equal ids, positions restart at 0 at each run, and a token attends only to
earlier tokens of its own run (block-causal), so a packed row computes exactly what its
examples compute one by one. Padding is a run of its own with IGNORE targets.

`Packing.of` turns segments into the per-token positions and the (b, 1, s, s) attention mask
once per forward (or pipeline stage call); every layer reads the same object. Runs are found
from changes of id, so the mask and the positions always agree. Segments None means plain
causal rows, and the model then runs exactly as without packing (SDPA with is_causal=True).

Attention takes the mask as an additive float mask (`Packing.additive`: 0 where a query sees
a key, -inf elsewhere), made once per micro-batch in the dtype attention runs in. SDPA given
the boolean mask builds exactly that tensor itself, in every call, and saves it for backward:
one (b, 1, s, s) copy per layer (at s = 4,096 over 32 layers, gigabytes). Given the one
tensor, every layer's SDPA saves the same storage, which the memory tracker counts once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class Packing:
    """Per-token positions (b, s) int64 and the block-causal mask (b, 1, s, s), True = sees."""

    positions: Tensor
    mask: Tensor
    _additive: dict[torch.dtype, Tensor] = field(default_factory=dict, repr=False, compare=False)

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

    def additive(self, dtype: torch.dtype) -> Tensor:
        """The mask as attention adds it, (b, 1, s, s) of `dtype`: 0 where `mask` is True,
        -inf elsewhere; what SDPA makes of a boolean mask (zeros, then -inf where it is
        False), so results are bitwise the boolean mask's. Made on first use and kept, so
        all layers share one tensor (and autograd saves one storage, not one per layer)."""
        if dtype not in self._additive:
            out = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._additive[dtype] = out.masked_fill_(self.mask.logical_not(), float("-inf"))
        return self._additive[dtype]

    def rows(self, start: int, length: int) -> Tensor:
        """Positions of sequence slice [start, start + length) (a sequence-parallel shard)."""
        return self.positions[:, start : start + length]
