"""ZeRO-R partitioned activations: each block's saved input held 1/tp per rank.

Under tensor parallelism without sequence parallelism every tp rank holds the same residual
stream, so the input a block saves for its backward (full recomputation: the checkpoint;
selective: the first norm's input) is one tensor stored tp times. With
`--partition-activations` (Rajbhandari et al., 2020, section 6.1: "partitioned activation
checkpointing"; DeepSpeed's `partition_activations`, Megatron's
`distribute_saved_activations`) each rank keeps only its 1/tp of it and the tp group
all-gathers the whole when backward unpacks it, to recompute the block or to run the norm's
backward: one all-gather of b·s·h elements per block per micro-batch, bought with
(1 - 1/tp)·b·s·h elements less per block held from forward to backward.

How: the block's forward runs under a pair of saved-tensor hooks. Pack recognises the
block's input (same storage, shape, strides, dtype and version), keeps this rank's slice of
it (a copy: the whole can then be freed) and hands the slice on to the hooks active outside
the block, so that under `--offload-activations cpu` (whose hooks wrap these) the slice is
what goes to the host, as DeepSpeed's CPU checkpointing moves its partitions, and the memory
tracker's meter counts the slice. Every other saved tensor passes through unchanged. Unpack
gathers; when several nodes saved the input (RMSNorm's fp32 input: the square and the
product), one gather serves all of them. The slice is the flattened tensor's contiguous
1/tp: whole token rows (the sequence dimension) when tp divides b·s, else a cut within rows
(the hidden size divides, since the heads do). Gathering restores the same values, so the
run is bitwise the one without partitioning. Gradients are unaffected: autograd gives the
unpacked tensor back its original place in the graph, so the gradient reaches the block's
input along the same edges as before.

A pipeline stage's received input (a leaf that requires grad) is not partitioned: the
pipeline keeps that buffer anyway, to send its gradient back.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.models.transformer import Block, Transformer
from plait.parallel.saved_tensors import Hooks, grad_leaf, saved_key, wrap_forward

TAG = "partition-activations"
"""The comm layer's tag for the gathers (CommStats.total(tag=TAG))."""


def this_part(t: Tensor, comm: Comm, axis: str = "tp") -> Tensor:
    """This rank's contiguous 1/n of flattened `t`, a copy of its own."""
    n, r = comm.mesh.size(axis), comm.mesh.axis_rank(axis)
    flat = t.detach().reshape(-1)
    if flat.numel() % n:
        raise ValueError(f"cannot partition {flat.numel()} elements over {n} {axis} ranks")
    return flat.chunk(n)[r].clone()


def gather_whole(part: Tensor, shape: torch.Size, comm: Comm, axis: str = "tp") -> Tensor:
    """Every rank's part, concatenated (one all-gather through the comm layer) and shaped."""
    out = part.new_empty(part.numel() * comm.mesh.size(axis))
    comm.all_gather(out, part, axis, tag=TAG)
    return out.view(shape)


def _hooks(x: Tensor, outer: Hooks, comm: Comm):
    """Pack and unpack that partition the block input `x` wherever it is saved, chained to
    `outer`; and what lets go of the slice they share when the block's forward ends."""
    outer_pack, outer_unpack = outer
    key = None if grad_leaf(x) else saved_key(x)  # a received input stays whole
    cache: dict = {"part": None, "whole": None, "left": 0}

    def pack(t: Tensor):
        if key is None or saved_key(t) != key:
            return (None, outer_pack(t))
        if cache["part"] is None:
            cache["part"] = this_part(t, comm)
        cache["left"] += 1
        return (t.shape, outer_pack(cache["part"]))

    def unpack(saved) -> Tensor:
        shape, inner = saved
        t = outer_unpack(inner)
        if shape is None:
            return t
        whole = cache["whole"]
        if whole is None:
            whole = gather_whole(t, shape, comm)
        cache["left"] -= 1  # kept for the other nodes that saved it, then let go
        cache["whole"] = whole if cache["left"] > 0 else None
        return whole

    def done() -> None:
        cache["part"] = None  # the saved entries hold the slice; the cache lets go

    return pack, unpack, done


def partition_module(block: nn.Module, comm: Comm) -> None:
    """Run `block`'s forward (recompute wrapper included) under the partitioning hooks."""
    wrap_forward(block, lambda x, outer: _hooks(x, outer, comm))


def apply_partition_activations(model: Transformer, comm: Comm, enabled: bool) -> list[nn.Module]:
    """Partition the saved input of every block this rank holds over tp (call after
    `apply_recompute` and before `apply_activation_offload`, so that the checkpoint's input
    is what is split and the slice is what moves); the wrapped blocks."""
    if not enabled or comm.mesh.size("tp") == 1:
        return []
    blocks: list[Block] = [model.get_submodule(p.path) for p in model.contract.blocks()]
    for block in blocks:
        partition_module(block, comm)
    return blocks
