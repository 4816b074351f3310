"""The model's parameters as views into flat buffers, and (stage 3) their sharding.

Every parameter's `.data` becomes a view into its group's flat buffer in the compute dtype,
so a collective on the buffer updates all of its parameters at once and the model's code
stays unchanged. Stages 0-2 keep the full buffer; each rank's shard is a view of it, and
after the optimizer step an in-place all-gather brings every rank's updated shard to all.

Stage 3 keeps only the shard. The full buffer still exists as a tensor, but its storage is
resized to zero bytes between uses (FSDP's original technique): the parameters and the
tensors autograd saved for backward are views of that storage, so gathering into it again
before backward makes them valid again without touching autograd.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from plait.comm import Comm, Handle
from plait.memory_tracker import MemoryTracker
from plait.models.contract import contract_of
from plait.parallel.zero.layout import FlatGroup


def flatten_values(
    group: FlatGroup,
    device: torch.device,
    value: Callable[[torch.nn.Parameter], Tensor] | None = None,
) -> Tensor:
    """The group's parameter values as one fp32 padded flat tensor: their current values, or
    `value(p)` for each (initial values of parameters not materialized yet)."""
    flat = torch.zeros(group.padded, dtype=torch.float32, device=device)
    for p, off in zip(group.params, group.offsets, strict=True):
        v = p.detach() if value is None else value(p)
        flat[off : off + p.numel()].copy_(v.reshape(-1))
    return flat


def initial_flat(
    group: FlatGroup,
    stage: int,
    device: torch.device,
    value: Callable[..., Tensor] | None = None,
) -> Tensor:
    """fp32 values of the group: all of them (stages 0-2), or this rank's shard (stage 3:
    from `value(p, rows)`, only the rows of each parameter that the shard overlaps are
    asked for, so a source reading a file reads 1/N of the model; from the current values,
    the shard of the flattened group)."""
    if stage != 3 or value is None:
        flat = flatten_values(group, device, value)
        return flat[group.lo : group.hi].clone() if stage == 3 else flat
    shard = torch.zeros(group.shard_numel, dtype=torch.float32, device=device)
    for piece in group.pieces():
        p = group.params[piece.param]
        row = p.shape[1:].numel()  # elements of one dim-0 row (1 for a vector)
        r0, r1 = piece.start // row, -(-(piece.start + piece.length) // row)
        band = value(p, (r0, r1)).reshape(-1)
        skip = piece.start - r0 * row
        shard[piece.shard_offset : piece.shard_offset + piece.length] = band[
            skip : skip + piece.length
        ]
    return shard


class ParamStore:
    """Flat compute-dtype parameter buffers (full or sharded) and the parameter views."""

    def __init__(
        self,
        groups: list[FlatGroup],
        values: list[Tensor],
        stage: int,
        dtype: torch.dtype,
        comm: Comm,
        axis: str,
        tracker: MemoryTracker,
        name: str = "params",
    ) -> None:
        """`name`: its memory-tracker keys and its all-gathers' tag ("frozen": a LoRA base,
        counted apart from the trainable parameters' gathers)."""
        self.groups, self.stage, self.comm, self.axis = groups, stage, comm, axis
        self.tracker, self.name = tracker, name
        self.gathered_key = "gathered:" if name == "params" else f"gathered-{name}:"
        self.full: list[Tensor] = []
        self.shards: list[Tensor] = []
        for g, flat in zip(groups, values, strict=True):
            if stage < 3:
                full = flat.to(dtype)  # the fp32 values themselves when dtype is fp32
                shard = full[g.lo : g.hi]
                tracker.track(f"{name}:{g.index}", "parameters", full)
            else:  # `flat` is only this rank's shard
                shard = flat.to(dtype, copy=True)
                full = torch.empty(g.padded, dtype=dtype, device=flat.device)
                tracker.track(f"{name}:{g.index}", "parameters", shard)
            self.full.append(full)
            self.shards.append(shard)
            self._bind(g, full)
            if stage == 3:
                full.untyped_storage().resize_(0)

    @staticmethod
    @torch.no_grad()
    def _bind(group: FlatGroup, full: Tensor) -> None:
        for p, off in zip(group.params, group.offsets, strict=True):
            p.data = full[off : off + p.numel()].view(p.shape)

    def all_gather(self) -> None:
        """Stages 1-2, after the step: every rank's updated shard into every full buffer."""
        handles = [
            self.comm.all_gather(full, shard, self.axis, tag=self.name, async_op=True)
            for full, shard in zip(self.full, self.shards, strict=True)
        ]
        for h in handles:
            h.wait()


class Gatherer:
    """Stage 3: all-gather each block's parameters before its forward and its backward, free
    them after, and prefetch the next block's gather so it overlaps the current compute.

    Groups come in backward order: blocks last-to-first, then the root (embedding, final
    norm, head). Forward runs root, block 0, 1, ...; backward runs root, block L-1, ..., 0.
    Every rank runs the same forward and backward, so all issue the same gathers in order.
    A LoRA run trains nothing at the root (its adapters are in the blocks): no root group.
    """

    def __init__(self, model: torch.nn.Module, store: ParamStore) -> None:
        self.store = store
        self.blocks = [model.get_submodule(part.path) for part in contract_of(model).blocks()]
        has_root = len(store.groups) > len(self.blocks)
        self.root: int | None = len(store.groups) - 1 if has_root else None
        self.handles: dict[int, Handle | None] = {}  # gathered groups -> in-flight handle
        self.backward = False
        self.keep = False  # blocks stay gathered after their forward (a pipeline's policy)
        self._hooks = [
            model.register_forward_pre_hook(self._root_pre),
            model.register_forward_hook(self._root_post),
        ]
        for i, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(self._block_pre(i)))
            self._hooks.append(block.register_forward_hook(self._block_post(i)))

    def group_of(self, block: int) -> int:
        return len(self.blocks) - 1 - block

    def _runs_after(self, i: int, j: int) -> bool:
        """Whether block `j`'s forward directly follows block `i`'s in one run, so its gather
        may be prefetched: any next block of the model (a pipeline: of the same chunk)."""
        return 0 <= j < len(self.blocks)

    # -- gather / release ------------------------------------------------------------
    def prefetch(self, gi: int) -> None:
        """Start gathering group `gi` unless it is gathered or on its way."""
        if gi in self.handles:
            return
        full, shard = self.store.full[gi], self.store.shards[gi]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        self.store.tracker.track(
            f"{self.store.gathered_key}{gi}", "parameters", full, transient=True
        )
        comm = self.store.comm
        self.handles[gi] = comm.all_gather(
            full, shard, self.store.axis, tag=self.store.name, async_op=True
        )

    def ensure(self, gi: int) -> None:
        """Group `gi` gathered and complete."""
        self.prefetch(gi)
        handle = self.handles[gi]
        if handle is not None:
            handle.wait()
            self.handles[gi] = None

    def release(self, gi: int) -> None:
        """Free group `gi`'s full buffer (its shard stays)."""
        if gi not in self.handles:
            return
        self.ensure(gi)  # never free memory a collective is still writing
        self.store.full[gi].untyped_storage().resize_(0)
        self.store.tracker.release(f"{self.store.gathered_key}{gi}")
        del self.handles[gi]

    # -- hooks -----------------------------------------------------------------------
    def _root_pre(self, module, args) -> None:
        self.backward = False
        if self.root is not None:
            self.ensure(self.root)
        if self.blocks:
            self.prefetch(self.group_of(0))

    def _root_post(self, module, args, output) -> None:
        if self.root is not None:
            self.release(self.root)
        if isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(self.pre_backward(None))

    def _block_pre(self, i: int):
        def hook(module, args) -> None:
            self.ensure(self.group_of(i))
            if not self.backward and self._runs_after(i, i + 1):
                self.prefetch(self.group_of(i + 1))

        return hook

    def _block_post(self, i: int):
        def hook(module, args, output) -> None:
            if self.backward or self.keep:  # a recomputation, or kept through the step
                return
            self.release(self.group_of(i))
            if isinstance(output, Tensor) and output.requires_grad:
                output.register_hook(self.pre_backward(i))

        return hook

    def pre_backward(self, block: int | None):
        """The hook that runs when the gradient of a block's output (None: the model's) is
        ready, i.e. just before that block's backward: gather it, prefetch the one before it.
        Public so that `frozen.FrozenGatherer` can add its own freeing to it."""

        def hook(grad: Tensor) -> None:
            self.backward = True
            if block is None:
                if self.root is not None:
                    self.ensure(self.root)
                nxt = len(self.blocks) - 1
            else:
                self.ensure(self.group_of(block))
                nxt = block - 1
            if nxt >= 0:
                self.prefetch(self.group_of(nxt))

        return hook

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every group gathered (to read or export the full parameters), freed afterwards."""
        for gi in range(len(self.store.groups)):
            self.ensure(gi)
        try:
            yield
        finally:
            for gi in range(len(self.store.groups)):
                self.release(gi)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
