"""The Packing a context-parallel rank's model attends with.

A rank holds s/cp tokens of each row (cut.py). Everything outside attention is per token,
so the model runs on them as on any rows, given what a Packing gives it: each token's
position within its document (RoPE and learned positions use them) and its document. The
attention differs only in its keys: this Packing's `keys_values` hands the layer every
rank's keys and values (allgather), and `bound` the rank's rows of the row's block-causal
rule, as an additive mask (b, 1, s/cp, s): a query sees a key of its own document at the
same place or before, compared by place in the row, whichever rank held the key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from plait.comm import Comm
from plait.models.packing import Packing
from plait.parallel.cp.cut import cut
from plait.parallel.cp.exchange import gather_kv
from plait.parallel.cp.ring import ring_attention


@dataclass(frozen=True)
class ContextPacking(Packing):
    """This rank's tokens of a micro-batch's rows. `index` (b, L): their places in the row;
    `key_index`, `key_runs` (b, s): every rank's tokens' places and documents, in the order
    the exchange delivers the keys (rank after rank)."""

    index: Tensor | None = None
    key_index: Tensor | None = None
    key_runs: Tensor | None = None
    comm: Comm | None = None
    exchange: str = "allgather"

    @classmethod
    def shard(
        cls, segments: Tensor | None, shape: tuple[int, int], comm: Comm, exchange: str
    ) -> ContextPacking:
        """This rank's share of rows of `shape` (b, s) with `segments` (None: one document a
        row, plain causal text)."""
        b, s = shape
        device = comm.mesh.device
        if segments is None:
            segments = torch.zeros(b, s, dtype=torch.int64, device=device)
        whole = Packing.of(segments, "mask")
        every = cut(whole.runs, comm.mesh.size("cp"))  # (cp, b, L)
        index = every[comm.mesh.axis_rank("cp")]  # (b, L)
        key_index = every.transpose(0, 1).reshape(b, s)  # (b, s)
        return cls(
            positions=whole.positions.gather(1, index),
            runs=whole.runs.gather(1, index),
            mode="mask",
            index=index,
            key_index=key_index,
            key_runs=whole.runs.gather(1, key_index),
            comm=comm,
            exchange=exchange,
        )

    def take(self, rows: Tensor) -> Tensor:
        """This rank's tokens of per-token `rows` (b, s): tokens, targets."""
        return rows.gather(1, self.index)

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """allgather: every rank's keys and values of the layer, (b, kv, s, hd), rank after
        rank. ring: this rank's, whose head count `attend` needs (GQA repeats them before
        attention; the ring passes them unrepeated), kept for it."""
        if self.exchange == "ring":
            self._made["kv_heads"] = k.shape[1]
            return k, v
        return gather_kv(k, v, self.comm)

    def windowed(self, window: int | None) -> Tensor:
        """This rank's rows of the block-causal rule (b, 1, L, s), True = sees (what `mask`
        and `additive` read); no window (refused before a run, composition.py)."""
        assert window is None, "context parallelism carries the block-causal rule only"
        if ("mask", None) not in self._made:
            same = self.runs.unsqueeze(-1) == self.key_runs.unsqueeze(-2)  # (b, L, s)
            earlier = self.key_index.unsqueeze(-2) <= self.index.unsqueeze(-1)  # (b, L, s)
            self._made[("mask", None)] = (same & earlier).unsqueeze(1)
        return self._made[("mask", None)]

    def bound(self, q: Tensor, explicit: bool, window: int | None = None) -> Tensor | Packing:
        """allgather: the additive mask over the gathered keys (`additive`, shared by every
        layer); ring: this Packing, whose `attend` runs the ring. A sliding `window` is
        refused before a run starts (composition.check_context_parallel)."""
        assert window is None, "context parallelism carries the block-causal rule only"
        return self if self.exchange == "ring" else self.additive(q.dtype)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, window: int | None = None, scale: float | None = None
    ) -> Tensor:
        """The ring (parallel/cp/ring.py) over k and v as the layer repeated them for GQA:
        one of each group of copies is passed, the ring repeats what it receives. A window or
        another score scale is refused before a run starts (composition.py)."""
        assert window is None and scale is None, "the ring carries the plain causal rule only"
        rep = k.shape[1] // self._made["kv_heads"]
        return ring_attention(q, k[:, ::rep], v[:, ::rep], self.sees, self.comm)

    def sees(self, j: int) -> Tensor:
        """This rank's rows of the rule against cp rank j's tokens, (b, 1, L, L)."""
        length = self.index.shape[1]
        return self.mask[..., j * length : (j + 1) * length]
