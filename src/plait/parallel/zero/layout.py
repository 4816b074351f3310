"""Where every parameter element lives: flat groups, their padding, and each rank's shard.

A *flat group* is one contiguous buffer holding consecutive parameters (a gradient bucket
for stages 0-2, one transformer block for stage 3). ZeRO splits each group into N equal
contiguous shards, one per data-parallel rank, so a group is padded with zeros to a multiple
of N; a shard may start or end inside a parameter. This file is pure arithmetic: no process
group, no communication, testable on its own.

    group   | p0 ........ | p1 ... | p2 ........... |pad|
    shards  | rank 0        | rank 1        | rank 2     |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from plait.models.contract import Part, contract_of
from plait.models.init import parameter_names
from plait.parallel.adamw import decays

NVME_SUB_GROUP_MB = 64.0
"""Default size of an NVMe offload sub-group: master weights and states streamed together."""
MAX_INFLIGHT_BUCKETS = 2
"""Stages 2-3: transient gradient buckets in flight at once (see zero/reducer.py)."""


def nvme_sub_group(sub_group_mb: float, n_states: int) -> int:
    """Elements per NVMe sub-group: `sub_group_mb` MiB over the fp32 master and the states."""
    return max(1, int(sub_group_mb * 2**20) // (4 + 4 * n_states))


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls inside a shard."""

    param: int  # index into FlatGroup.params
    start: int  # first element, in the parameter's flattened order
    length: int
    shard_offset: int  # where it starts inside the shard


@dataclass
class FlatGroup:
    """Consecutive parameters in one padded flat buffer, sharded over `world` ranks."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    numel: int  # without padding
    padded: int  # a multiple of the number of shards
    rank: int
    world: int

    @property
    def padding(self) -> int:
        return self.padded - self.numel

    @property
    def shard_numel(self) -> int:
        return self.padded // self.world

    @property
    def lo(self) -> int:
        """First element of this rank's shard in the group."""
        return self.rank * self.shard_numel

    @property
    def hi(self) -> int:
        return self.lo + self.shard_numel

    def pieces(self) -> list[ShardPiece]:
        """The parameters (parts of them) inside this rank's shard, in order; padding skipped."""
        out = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets, strict=True)):
            start, end = max(off, self.lo), min(off + p.numel(), self.hi)
            if start < end:
                out.append(ShardPiece(i, start - off, end - start, start - self.lo))
        return out

    def decay_segments(self) -> list[tuple[int, int]]:
        """(start, end) ranges of the shard that get weight decay: matrices and embeddings,
        never biases or norm gains (`adamw.decays`)."""
        segments: list[tuple[int, int]] = []
        for piece in self.pieces():
            if not decays(self.params[piece.param]):
                continue
            start, end = piece.shard_offset, piece.shard_offset + piece.length
            if segments and segments[-1][1] == start:  # adjacent matrices: one range
                segments[-1] = (segments[-1][0], end)
            else:
                segments.append((start, end))
        return segments


def padded_size(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


def bucket_runs(nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of items of `nbytes` bytes each, in reverse order, in runs of at most
    `bucket_bytes` (an item larger than the cap gets a run of its own).

    Pure arithmetic on sizes, so the memory estimator (`plait.estimate`) forms the same
    buckets as the engine without a model."""
    runs: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(nbytes))):
        if current and size + nbytes[i] > bucket_bytes:
            runs.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes[i]
    if current:
        runs.append(current)
    return runs


def assign_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters, in reverse order, into runs of at most `bucket_bytes` each.

    Reverse registration order approximates the order in which backward produces the
    gradients (the last layer's first), so the first bucket fills first and its reduction
    overlaps the rest of backward.

    A parameter larger than the cap gets a bucket of its own: never split, so each gradient
    stays one view (as torch DDP does).
    """
    sizes = [p.numel() * p.element_size() for p in params]
    return [[params[i] for i in run] for run in bucket_runs(sizes, bucket_bytes)]


def trainable_params(
    model: nn.Module, parts: Sequence[Part] | None = None, trainable: bool = True
) -> list[nn.Parameter]:
    """The parameters of `parts` (default: all this rank holds) that train, in registration
    order, as the model's contract declares them: frozen ones get no group at all. With
    `trainable=False`, the frozen ones instead (a LoRA run's base: `frozen_groups`)."""
    return [p for e, p in contract_of(model).bind(model, parts) if e.decl.trainable == trainable]


def block_units(model: nn.Module, trainable: bool = True) -> list[list[nn.Parameter]]:
    """Stage 3's gather units in backward order: the last block first, the root last.

    Each transformer block is a unit (gathered for its forward and its backward); the rest
    (embedding, final norm, head) is the *root*, which the first and the last layers share
    (a tied embedding is both), so it is gathered around the whole forward and the whole
    backward, as FSDP treats its root module. `trainable=False`: the frozen parameters'
    units, gathered alongside (zero/frozen.py).
    """
    units: list[list[nn.Parameter]] = []
    taken: set[int] = set()
    for part in reversed(contract_of(model).blocks()):
        unit = [p for p in trainable_params(model, [part], trainable) if id(p) not in taken]
        taken.update(id(p) for p in unit)
        units.append(unit)
    units.append([p for p in trainable_params(model, None, trainable) if id(p) not in taken])
    return units


def build_groups(
    model: nn.Module,
    stage: int,
    bucket_bytes: int,
    rank: int,
    world: int,
    isolate: Sequence[nn.Parameter] = (),
) -> list[FlatGroup]:
    """Flat groups in the order backward completes them (so reductions launch in order).

    Stages 0-2: byte-capped buckets in reverse registration order (as data parallelism).
    Stage 3: one group per block (see `block_units`). Stage 0 shards nothing (one shard);
    stages 1-3 pad each group to a multiple of `world`. Each parameter in `isolate` gets a
    group of its own, after the others: its shard on a rank then depends only on its own
    size, so two pipeline stages holding copies of a tied embedding shard them alike. A
    parameter the contract declares frozen is in no group: no gradient, no state, no master.
    """
    names = parameter_names(model)
    alone = {id(p) for p in isolate}
    trainable = trainable_params(model)
    params = [p for p in trainable if id(p) not in alone]
    lists = block_units(model) if stage == 3 else assign_buckets(params, bucket_bytes)
    lists = [[p for p in group if id(p) not in alone] for group in lists]
    lists += [[p] for p in isolate if any(p is q for q in trainable)]
    shards, me = (1, 0) if stage == 0 else (world, rank)
    return _flat_groups(lists, names, me, shards)


def frozen_groups(
    model: nn.Module, rank: int, world: int, skip: frozenset[int] = frozenset()
) -> list[FlatGroup]:
    """Stage 3 with a frozen base (LoRA): the frozen parameters' flat groups, one per block
    and the root (`block_units(trainable=False)`), sharded over `world` ranks like the
    trainable ones, but never given a gradient, a master or an optimizer state. `skip`: ids
    of parameters held otherwise (an NF4 base's weights: zero/nf4_shards.py)."""
    units = [[p for p in u if id(p) not in skip] for u in block_units(model, trainable=False)]
    return _flat_groups(units, parameter_names(model), rank, world)


def _flat_groups(
    lists: list[list[nn.Parameter]], names: dict[int, str], rank: int, shards: int
) -> list[FlatGroup]:
    """The non-empty lists as padded flat groups, numbered in order."""
    groups = []
    for i, group in enumerate(p for p in lists if p):
        offsets, numel = [], 0
        for p in group:
            offsets.append(numel)
            numel += p.numel()
        padded = padded_size(numel, shards)
        group_names = [names[id(p)] for p in group]
        groups.append(FlatGroup(i, group, group_names, offsets, numel, padded, rank, shards))
    return groups
