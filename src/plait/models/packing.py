"""Packed rows: several examples in one row, each with its own positions and no cross-talk.

`segments` (b, s) int64 says which example each token belongs to: every example is one
contiguous run of equal ids, positions restart at 0 at each run, and a token attends only to
earlier tokens of its own run (block-causal), so a packed row computes exactly what its
examples compute one by one. Padding is a run of its own with IGNORE targets.

`Packing.of` turns segments into the per-token positions and the runs once per forward (or
pipeline stage call); every layer reads the same object. Runs are found from changes of id,
so the attention and the positions always agree. Segments None means plain causal rows, and
the model then runs exactly as without packing (SDPA with is_causal=True).

How attention honours the runs is the Packing's `mode` (models/packed_attention.py): the
dense (b, 1, s, s) block-causal mask (`mask`, the reference), one causal attention per run
(`per-document`), or flash attention's variable-length kernel over the runs' offsets
(`varlen`, CUDA). Each is made on first use and kept, so every layer shares it.

The mask path adds the mask as an additive float mask (`Packing.additive`: 0 where a query
sees a key, -inf elsewhere), made once per micro-batch in the dtype attention runs in. SDPA
given the boolean mask builds exactly that tensor itself, in every call, and saves it for
backward: one (b, 1, s, s) copy per layer (at s = 4,096 over 32 layers, gigabytes). Given the
one tensor, every layer's SDPA saves the same storage, which the memory tracker counts once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import torch
from torch import Tensor

from plait.models.kv_cache import causal_mask
from plait.models.packed_attention import (
    MODES,
    attention_path,
    document_attention,
    varlen_attention,
)


@dataclass(frozen=True)
class Packing:
    """Per-token positions (b, s) int64 and run ids (b, s) (a new id where a run starts),
    and how attention honours the runs (`mode`, one of packed_attention.MODES)."""

    positions: Tensor
    runs: Tensor
    mode: str = "auto"
    _made: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, segments: Tensor | Packing | None, mode: str = "auto") -> Packing | None:
        """From segment ids (b, s); None stays None (plain causal rows), and a Packing made
        already (a context-parallel rank's, parallel/cp) is taken as it is."""
        if segments is None or isinstance(segments, Packing):
            return segments
        if segments.dim() != 2:
            raise ValueError(f"segments must be (batch, seq), got shape {tuple(segments.shape)}")
        if mode not in MODES:
            raise ValueError(f"packed attention must be one of {', '.join(MODES)}; got {mode!r}")
        b, s = segments.shape
        change = torch.ones(b, s, dtype=torch.bool, device=segments.device)
        change[:, 1:] = segments[:, 1:] != segments[:, :-1]  # a run starts here
        index = torch.arange(s, device=segments.device).expand(b, s)
        starts = torch.where(change, index, torch.zeros_like(index)).cummax(dim=1).values
        runs = change.long().cumsum(dim=1)  # (b, s) run id per token
        return cls(positions=index - starts, runs=runs, mode=mode)

    @property
    def mask(self) -> Tensor:
        """The block-causal mask (b, 1, s, s), True = sees: same run, not later."""
        return self.windowed(None)

    def windowed(self, window: int | None) -> Tensor:
        """The block-causal mask seeing at most the last `window` positions (None: all)."""
        if ("mask", window) not in self._made:
            s = self.runs.shape[1]
            causal = causal_mask(0, s, self.runs.device, window)  # (s, s)
            same = self.runs.unsqueeze(-1) == self.runs.unsqueeze(-2)  # (b, s, s)
            self._made[("mask", window)] = (same & causal).unsqueeze(1)
        return self._made[("mask", window)]

    def additive(self, dtype: torch.dtype, window: int | None = None) -> Tensor:
        """The mask as attention adds it, (b, 1, s, s) of `dtype`: 0 where `mask` is True,
        -inf elsewhere; what SDPA makes of a boolean mask (zeros, then -inf where it is
        False), so results are bitwise the boolean mask's. Made on first use and kept, so
        all layers share one tensor (and autograd saves one storage, not one per layer);
        `window`: the sliding window's (one more tensor, shared by its layers)."""
        if (dtype, window) not in self._made:
            mask = self.windowed(window)
            out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            self._made[(dtype, window)] = out.masked_fill_(mask.logical_not(), float("-inf"))
        return self._made[(dtype, window)]

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values the layer's queries meet: its own; a context-parallel rank's
        Packing (parallel/cp/packing.py) returns every rank's."""
        return k, v

    def bound(self, q: Tensor, explicit: bool, window: int | None = None) -> Tensor | Packing:
        """What bounds attention over `q` (b, a, s, hd): the additive mask on the mask path
        (the mode, or `explicit`: keyed dropout needs the whole probabilities), else this
        Packing, which attends by document (`attend`). The mask reaches the attention core
        as a tensor argument, so selective recomputation's checkpoint saves it, as the
        memory it holds."""
        path = attention_path(self.mode, q.device.type, q.dtype, explicit)
        return self.additive(q.dtype, window) if path == "mask" else self

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, window: int | None = None, scale: float | None = None
    ) -> Tensor:
        """Causal attention within each run, (b, a, s, hd) in and out (k, v with q's heads):
        the per-document loop, or varlen where the mode (auto on CUDA) picks it; `window`
        and `scale` as the attention core's (models/core_attention.py)."""
        path = attention_path(self.mode, q.device.type, q.dtype, explicit=False)
        if path == "varlen":
            offsets, longest = self.offsets()
            return varlen_attention(q, k, v, offsets, longest, window, scale)
        return document_attention(q, k, v, self.documents(), window, scale)

    def offsets(self) -> tuple[Tensor, int]:
        """The runs over the flattened (b·s) tokens as flash attention's varlen kernel takes
        them: int32 offsets (runs + 1,) on the runs' device, and the longest run. A row's
        first token always starts a run, so no run crosses rows."""
        if "offsets" not in self._made:
            b, s = self.runs.shape
            flat = self.runs.new_ones(b, s, dtype=torch.bool)
            flat[:, 1:] = self.runs[:, 1:] != self.runs[:, :-1]
            starts = flat.flatten().nonzero().squeeze(1)  # (runs,)
            end = torch.tensor([b * s], device=starts.device)
            offsets = torch.cat([starts, end]).to(torch.int32)
            self._made["offsets"] = (offsets, int((offsets[1:] - offsets[:-1]).max()))
        return self._made["offsets"]

    def documents(self) -> list[tuple[int, int, int]]:
        """Each run as (row, start, end), in order; read to the host once per Packing."""
        if "documents" not in self._made:
            s = self.runs.shape[1]
            flat = self.offsets()[0].tolist()
            self._made["documents"] = [(a // s, a % s, a % s + (z - a)) for a, z in pairwise(flat)]
        return self._made["documents"]

    def rows(self, start: int, length: int) -> Tensor:
        """Positions of sequence slice [start, start + length) (a sequence-parallel shard)."""
        return self.positions[:, start : start + length]


Bound = Tensor | Packing | None  # what the attention core takes: a mask, a Packing or neither
