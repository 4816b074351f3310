"""ZeRO-3 over an NF4 base: each block's packed bytes sharded over dp, gathered per block.

The NF4 weights of one block (zero/nf4_base.py) go into one flat uint8 buffer, weight after
weight, each its codes then its absmax codes, padded to a multiple of N = dp; a rank keeps
1/N of it. The nested scales and the offset (fp32, 1/16384 of a weight and one number) stay
whole on every rank beside the shards: they are what turns gathered bytes back into exactly
the weight's values. Each weight's `NF4Tensor` is rebound to views of the block's full buffer,
whose storage is freed between uses and re-filled by an all-gather, as the fp groups are
(flat_params.py: the views stay valid), so a block's Linears compute through the same
`HeldNF4` before and after.

`NF4Store` offers what `flat_params.Gatherer` reads of a store (`groups`, `full`, `shards`,
the tracker and the tag), so the frozen base's gatherers (frozen.FrozenGatherer, and
pipeline_gather.PipelineGatherer under a pipeline) drive it unchanged: each block's bytes are
all-gathered before its forward and again before its backward (tag "nf4"), 2·m per step over
m micro-batches, 0.52 bytes per weight where a bf16 base moves 2.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.memory_tracker import MemoryTracker
from plait.models.contract import contract_of
from plait.models.nf4.linear import HeldNF4
from plait.parallel.zero.frozen import FrozenGatherer
from plait.parallel.zero.layout import padded_size
from plait.parallel.zero.pipeline_gather import PipelineGatherer
from plait.schedule.stages import StagePlan


class NF4Store:
    """One flat uint8 group per block (in the gatherer's order: last block first), sharded."""

    def __init__(
        self,
        model: nn.Module,
        held: dict[str, HeldNF4],
        comm: Comm,
        axis: str,
        tracker: MemoryTracker,
    ) -> None:
        self.comm, self.axis, self.tracker = comm, axis, tracker
        self.name, self.gathered_key = "nf4", "gathered-nf4:"
        n, rank = comm.mesh.size(axis), comm.mesh.axis_rank(axis)
        blocks = [part.path for part in contract_of(model).blocks()]
        self.groups: list[list[str]] = []
        self.full: list[Tensor] = []
        self.shards: list[Tensor] = []
        for path in reversed(blocks):  # flat_params.Gatherer.group_of: last block first
            names = [name for name in held if name.startswith(path + ".")]
            full = self._flatten([held[name] for name in names], n)
            shard_len = full.numel() // n
            shard = full[rank * shard_len : (rank + 1) * shard_len].clone()
            gi = len(self.groups)
            self.groups.append(names)
            self.full.append(full)
            self.shards.append(shard)
            tracker.track(f"nf4:{gi}", "parameters", shard)
            for name in names:
                tracker.release(f"nf4:{name}")  # held whole until now (nf4_base.hold_nf4)
                constants = held[name].weight.nested.numel() * 4 + 4
                tracker.track(f"nf4-constants:{name}", "parameters", constants)
            full.untyped_storage().resize_(0)

    @staticmethod
    @torch.no_grad()
    def _flatten(weights: list[HeldNF4], shards: int) -> Tensor:
        """The block's codes and absmax codes in one padded buffer; each weight rebound to
        its views of it."""
        sizes = [h.weight.codes.numel() + h.weight.absmax.numel() for h in weights]
        device = weights[0].weight.codes.device if weights else torch.device("cpu")
        full = torch.zeros(padded_size(sum(sizes), shards), dtype=torch.uint8, device=device)
        offset = 0
        for h in weights:
            t = h.weight
            nc, na = t.codes.numel(), t.absmax.numel()
            full[offset : offset + nc] = t.codes
            full[offset + nc : offset + nc + na] = t.absmax
            codes, absmax = full[offset : offset + nc], full[offset + nc : offset + nc + na]
            h.weight = t.with_tensors((codes, absmax, t.nested, t.offset))
            offset += nc + na
        return full


def shard_nf4(
    model: nn.Module,
    held: dict[str, HeldNF4],
    comm: Comm,
    axis: str,
    tracker: MemoryTracker,
    plans: Sequence[StagePlan] | None = None,
    keep: bool = True,
) -> FrozenGatherer | PipelineGatherer:
    """Stage 3: shard the NF4 base's bytes per block and return their gatherer (under a
    pipeline, `plans`, one that keeps the stage gathered through the step or not)."""
    store = NF4Store(model, held, comm, axis, tracker)
    if plans:
        return PipelineGatherer(model, store, plans, keep)
    return FrozenGatherer(model, store)
