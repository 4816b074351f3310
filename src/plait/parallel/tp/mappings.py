"""The f and g operators of Megatron-LM as autograd Functions: a block's tp all-reduces.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019), figure 3: a block is split into a column-parallel part and a
row-parallel part, bracketed by two conjugate operators,

    f  (copy to the tp region):     forward identity,   backward all-reduce
    g  (reduce from the tp region): forward all-reduce, backward identity

so each block needs one all-reduce forward (g) and one backward (f). Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (2022), section 4.2.2,
splits each all-reduce into its two halves for sequence parallelism:

    g     (gather from the sequence region): forward all-gather,     backward reduce-scatter
    g-bar (reduce-scatter to the sequence):  forward reduce-scatter, backward all-gather

Two more helpers move a tensor between replicated and split along its last dimension
(gather-from-region, scatter-to-region), as Megatron's do. Each Function takes the Comm, the
axis and a tag explicitly (no global group read inside backward), and all traffic goes
through `comm.py`, whose collectives work on dim 0: a tensor is moved to put the split
dimension first (contiguous) around the call.

Where the tensor-parallel all-reduce is: here, and it runs where `layers.py` calls it. A
block's column-parallel layers enter the region once (`enter_region`, from the `EnterRegion`
hook `apply.py` puts on the attention and the MLP) and its row-parallel layers leave it
(`exit_region`); the vocabulary-parallel embedding leaves it too, and a head that must give
whole logits gathers them (`gather_from_tp`). The other tp collectives are not activations
moving through the block, so they live with the rule they serve, each through `comm.py`:

    tp/vocab.py                   the vocab-parallel cross-entropy's per-token max and sums
    parallel/grads.py             partial gradients summed over tp once per step (under SP:
                                  norm gains, row-parallel biases; LoRA's A beside a
                                  column-parallel weight), and the global norm's squares
    parallel/partition_activations.py   a block's saved input gathered for its backward
    tp/sharding.py                a shard gathered whole (`full_tensor`, for tests' checks)

What each costs, with its tag in `comm.stats`, is docs/tensor-parallel.md's table; the
figures per micro-batch are `estimate/formulas.tp_comm_per_microbatch`, which
`tests/test_tp_model.py` checks against the counted collectives.
"""

from __future__ import annotations

import torch
from torch import Tensor

from plait.comm import Comm


# ---------------------------------------------------------------- collectives along a dim
def _all_reduce(x: Tensor, comm: Comm, axis: str, tag: str) -> Tensor:
    """Sum over `axis` into a new tensor (the input may be saved for another backward)."""
    if comm.mesh.size(axis) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, axis, tag=tag)
    return out


def _split(x: Tensor, dim: int, comm: Comm, axis: str) -> Tensor:
    """This rank's contiguous 1/n of `x` along `dim` (no communication)."""
    n = comm.mesh.size(axis)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} into {n} equal parts")
    return x.chunk(n, dim)[comm.mesh.axis_rank(axis)].contiguous()


def _gather(x: Tensor, dim: int, comm: Comm, axis: str, tag: str) -> Tensor:
    """Concatenate every rank's `x` along `dim`."""
    n = comm.mesh.size(axis)
    if n == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((n * front.shape[0], *front.shape[1:]))
    comm.all_gather(out, front, axis, tag=tag)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: Tensor, dim: int, comm: Comm, axis: str, tag: str) -> Tensor:
    """Sum every rank's `x` and keep this rank's 1/n along `dim`."""
    n = comm.mesh.size(axis)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {n} ranks")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // n, *front.shape[1:]))
    comm.reduce_scatter(out, front, axis, tag=tag)
    return out.movedim(0, dim).contiguous()


# ---------------------------------------------------------------- Megatron's f and g
class CopyToTPRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward.

    Where a replicated activation enters column-parallel layers: each rank's backward
    yields only the input gradient through its own columns; their sum is the whole.
    """

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm, axis: str, tag: str) -> Tensor:
        ctx.comm, ctx.axis, ctx.tag = comm, axis, tag
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_reduce(grad, ctx.comm, ctx.axis, ctx.tag), None, None, None


class ReduceFromTPRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward.

    After row-parallel layers: each rank holds a partial sum of the output; every rank's
    copy of the summed output gets the same gradient, which is each partial's gradient.
    """

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm, axis: str, tag: str) -> Tensor:
        return _all_reduce(x, comm, axis, tag)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None, None


class GatherFromTPRegion(torch.autograd.Function):
    """All-gather forward along the last dim, split backward (e.g. gathered logits)."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm, axis: str, tag: str) -> Tensor:
        ctx.comm, ctx.axis = comm, axis
        return _gather(x, x.dim() - 1, comm, axis, tag)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _split(grad, grad.dim() - 1, ctx.comm, ctx.axis), None, None, None


class ScatterToTPRegion(torch.autograd.Function):
    """Split forward along the last dim, all-gather backward (a row-parallel layer's input)."""

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm, axis: str, tag: str) -> Tensor:
        ctx.comm, ctx.axis, ctx.tag = comm, axis, tag
        return _split(x, x.dim() - 1, comm, axis)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather(grad, grad.dim() - 1, ctx.comm, ctx.axis, ctx.tag), None, None, None


# ---------------------------------------------------------------- sequence parallelism
class GatherFromSequenceRegion(torch.autograd.Function):
    """Korthikanti's g: all-gather the sequence forward, reduce-scatter it backward.

    Replaces f under sequence parallelism: sequence shards (b, s/tp, h) become the full
    (b, s, h) that column-parallel layers need; their partial input gradients are summed
    and each rank keeps its own positions.
    """

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm, dim: int, axis: str, tag: str) -> Tensor:
        ctx.comm, ctx.dim, ctx.axis, ctx.tag = comm, dim, axis, tag
        return _gather(x, dim, comm, axis, tag)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = _reduce_scatter(grad, ctx.dim, ctx.comm, ctx.axis, ctx.tag)
        return out, None, None, None, None


class ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Korthikanti's g-bar: reduce-scatter the sequence forward, all-gather it backward.

    Replaces g under sequence parallelism: the row-parallel partial sums (b, s, h) are
    summed and each rank keeps only its sequence shard (b, s/tp, h).
    """

    @staticmethod
    def forward(ctx, x: Tensor, comm: Comm, dim: int, axis: str, tag: str) -> Tensor:
        ctx.comm, ctx.dim, ctx.axis, ctx.tag = comm, dim, axis, tag
        return _reduce_scatter(x, dim, comm, axis, tag)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather(grad, ctx.dim, ctx.comm, ctx.axis, ctx.tag), None, None, None, None


# ---------------------------------------------------------------- functional forms
def copy_to_tp(x: Tensor, comm: Comm, axis: str = "tp", tag: str = "tp") -> Tensor:
    return CopyToTPRegion.apply(x, comm, axis, tag)


def reduce_from_tp(x: Tensor, comm: Comm, axis: str = "tp", tag: str = "tp") -> Tensor:
    return ReduceFromTPRegion.apply(x, comm, axis, tag)


def gather_from_tp(x: Tensor, comm: Comm, axis: str = "tp", tag: str = "tp") -> Tensor:
    return GatherFromTPRegion.apply(x, comm, axis, tag)


def scatter_to_tp(x: Tensor, comm: Comm, axis: str = "tp", tag: str = "tp") -> Tensor:
    return ScatterToTPRegion.apply(x, comm, axis, tag)


def gather_from_sequence(
    x: Tensor, comm: Comm, dim: int = 1, axis: str = "tp", tag: str = "tp"
) -> Tensor:
    return GatherFromSequenceRegion.apply(x, comm, dim, axis, tag)


def reduce_scatter_to_sequence(
    x: Tensor, comm: Comm, dim: int = 1, axis: str = "tp", tag: str = "tp"
) -> Tensor:
    return ReduceScatterToSequenceRegion.apply(x, comm, dim, axis, tag)


def enter_region(x: Tensor, comm: Comm, sequence_parallel: bool, tag: str = "tp") -> Tensor:
    """Before column-parallel layers: f, or the sequence all-gather under SP. (b, s, h)"""
    if sequence_parallel:
        return gather_from_sequence(x, comm, dim=1, tag=tag)
    return copy_to_tp(x, comm, tag=tag)


def exit_region(x: Tensor, comm: Comm, sequence_parallel: bool, tag: str = "tp") -> Tensor:
    """After row-parallel layers: g, or the sequence reduce-scatter under SP.

    (b, s, h) partial sums -> (b, s, h), or (b, s/tp, h) under SP.
    """
    if sequence_parallel:
        return reduce_scatter_to_sequence(x, comm, dim=1, tag=tag)
    return reduce_from_tp(x, comm, tag=tag)
