"""A context-parallel rank's micro-batches: its tokens of the rows its replica draws.

Every cp rank of a replica draws the replica's micro-batches (`StepBatches`, the dp
coordinate alone chooses them) and keeps its s/cp tokens of each row (parallel/cp/cut.py):
tokens and targets taken at its places, and `segments` replaced by the ContextPacking
that tells the model each token's position and document and how to reach the other
ranks' keys. The loss's divisor is the replica's divided by cp: the summed target losses
of a replica's cp ranks over `denom / cp`, averaged over dp x cp (where the gradients are
reduced), give exactly what one rank holding the whole rows gives averaged over dp.
"""

from __future__ import annotations

from dataclasses import replace

from plait.comm import Comm
from plait.data.batches import MicroBatch, StepBatches
from plait.parallel.cp.packing import ContextPacking


class ContextBatches:
    """`StepBatches` whose micro-batches hold this cp rank's tokens; the rest is the
    replica's (sampler, positions, target counts)."""

    def __init__(self, whole: StepBatches, comm: Comm, exchange: str) -> None:
        self.whole, self.comm, self.exchange = whole, comm, exchange

    def __getattr__(self, name: str):
        return getattr(self.whole, name)  # sampler, position, target_tokens, device...

    def draw(self, step: int) -> list[MicroBatch]:
        return [self.local(mb) for mb in self.whole.draw(step)]

    def validation(self, batches: int) -> list[MicroBatch]:
        return [self.local(mb) for mb in self.whole.validation(batches)]

    def local(self, mb: MicroBatch) -> MicroBatch:
        """This rank's tokens of `mb`'s rows, with their ContextPacking."""
        pack = ContextPacking.shard(mb.segments, tuple(mb.tokens.shape), self.comm, self.exchange)
        denom = None if mb.denom is None else mb.denom / self.comm.mesh.size("cp")
        return replace(mb, tokens=pack.take(mb.tokens), targets=pack.take(mb.targets),
                       segments=pack, denom=denom)  # fmt: skip
