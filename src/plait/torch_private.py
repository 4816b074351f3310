"""Every private or deprecated torch API plait uses, each with why and the public alternative.

A private name (`torch.x._y`, `module._method`) can change or vanish in any torch release
without a deprecation period, so plait calls none of them anywhere else: when torch moves
one, this file is the one to fix, and the reason it was needed is next to it. (The benchmarks
and the course's lessons measure torch itself; what they read of torch's internals is routed
here too, or said where it is used: `benchmarks/zero_sides.py`, `benchmarks/pp_sides.py`.)

Gone from this list: `dist.distributed_c10d._get_default_store()` (the stop agreement of
`Comm.agreed_stop`); the launcher now keeps the store it initialises the process group with
and hands it over in the `Mesh` (`mesh.store`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

BoxOnRank = tuple[Sequence[int], Sequence[int], int, str]
"""(offsets, sizes, rank, device) of one box of a tensor in single-process coordinates."""


def sharded_tensor(
    local: Sequence[tuple[Sequence[int], Sequence[int], Tensor]],
    every: Sequence[BoxOnRank],
    size: Sequence[int],
    rank: int,
) -> Tensor:
    """A tensor of `size` of which this rank holds the boxes `local` ((offsets, sizes,
    data)), and `every` rank the boxes listed, for `torch.distributed.checkpoint` to write.

    Why private: a checkpoint box is any rectangle (a ZeRO shard cut across a tp shard gives
    several irregular boxes per rank), and `ShardedTensor` is the one tensor type DCP's
    default planner writes as arbitrary boxes. It lives in `torch.distributed._shard`, which
    torch is deprecating, and `_init_from_local_shards_and_global_metadata` is the constructor
    that takes every rank's boxes without a collective (`plait.checkpoint.state` gathers them
    once for all tensors). Public alternatives: DTensor, once its placements can describe
    irregular boxes (today Shard(dim) splits one dimension in even chunks), or a custom
    `torch.distributed.checkpoint.SavePlanner`/`LoadPlanner` that emits one `WriteItem` with
    a `ChunkStorageMetadata` per box (`torch.distributed.checkpoint.planner`, public),
    which takes over what the default planner does for ShardedTensor today.
    """
    shards = [Shard(data.contiguous(), _box(o, s, rank, str(data.device))) for o, s, data in local]
    meta = ShardedTensorMetadata(
        shards_metadata=[_box(*box) for box in every],
        size=torch.Size(size),
        tensor_properties=TensorProperties(dtype=local[0][2].dtype),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


def _box(offsets: Sequence[int], sizes: Sequence[int], rank: int, device: str) -> ShardMetadata:
    return ShardMetadata(list(offsets), list(sizes), f"rank:{rank}/{device}")


def embedding_left_unset(num: int, dim: int) -> nn.Embedding:
    """An `nn.Embedding` whose weight is the tensor allocated for it, not drawn from N(0, 1).

    Why private: `nn.Embedding(..., _weight=w)` takes `w` as the weight and skips
    `reset_parameters`. plait builds every model on the meta device and fills the values
    itself (`build/model.py` `build_model`); on meta, `normal_` runs through torch's Python
    decompositions, whose first use imports torch's compiler stack (torch._dynamo, sympy:
    over a second of start-up in every worker, the launched ones and a test world's alike)
    to draw nothing. Public alternative: `torch.nn.utils.skip_init`, which builds the module
    on meta too, so it pays the same import."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def replace_tensors(module: nn.Module, fn: Callable[[Tensor], Tensor]) -> None:
    """Replace every parameter and buffer of `module` by `fn(tensor)`, one at a time.

    Why private: `nn.Module._apply` is the walk behind `Module.to`, `to_empty` and `cuda`:
    it keeps each `nn.Parameter` (and its `requires_grad`) while swapping its tensor, and
    covers buffers and submodules. plait needs it with its own `fn` (a zero-byte tensor on
    the target device, `train._to_device_without_storage`) so that a model too large for one
    device is never allocated whole. Public alternative: `Module.to_empty(device=...)`,
    which allocates every tensor and keeps them all (the whole model at once)."""
    module._apply(fn)


@contextmanager
def parameters_as(module: nn.Module, values: Mapping[str, Tensor]) -> Iterator[None]:
    """Inside the block, `module.NAME` is `values[NAME]` (a plain tensor) for each name given,
    its own Parameter again after (also when the forward raised).

    Why private: `Module._parameters` is where `module.weight` is looked up; a LoRA run holds
    a frozen base in another dtype than it computes in (`--base-dtype`) and its layers must
    see a cast copy for one forward (`mixed_precision.compute_frozen_in`), saved by autograd
    as that copy, while the Parameter keeps its own storage. `setattr` refuses a tensor that
    is not a Parameter under a parameter's name. Public alternative:
    `torch.func.functional_call`, which swaps through the same dict (its helper is private
    too) and calls the module anew, so it cannot run inside the module's own forward."""
    held = {name: module._parameters[name] for name in values}
    module._parameters.update(values)
    try:
        yield
    finally:
        module._parameters.update(held)


def view_base(t: Tensor) -> Tensor:
    """The tensor `t` is a view of, or `t` itself.

    Why private: `Tensor._base` is how autograd knows a view's base; the activation meter
    (`memory_tracker.MemoryTracker.activations`) uses it to tell a saved view of a parameter
    (a Linear saves `weight.t()`) from an activation. Public alternative: comparing
    `t.untyped_storage().data_ptr()` with every parameter's storage, a set to keep current
    through ZeRO-3's gathers and 2BW's copies."""
    return t if t._base is None else t._base


def ddp_logging_data(ddp: nn.Module) -> dict[str, Any]:
    """`DistributedDataParallel`'s own record of its buckets (`bucket_sizes`,
    `rebuilt_bucket_sizes`: bytes, comma-separated) and settings.

    Why private: `_get_ddp_logging_data` is the only place DDP reports the buckets it built
    (in C++); the lessons and the DDP benchmark compare them with plait's. Public
    alternative: a communication hook (`DistributedDataParallel.register_comm_hook`) sees
    each bucket's `GradBucket.buffer()` as it is reduced, at the cost of replacing DDP's
    all-reduce with the hook's own."""
    return ddp._get_ddp_logging_data()


def outer_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The (pack, unpack) pair of the innermost `saved_tensors_hooks` context now active.

    Private: `torch._C._autograd._top_saved_tensors_default_hooks`. Only the innermost pair
    of hooks sees a saved tensor, so activation offload (hooks around each block) would hide
    the block's tensors from the memory tracker's meter (hooks around the step); chaining to
    the outer pair keeps both. Public alternative: none (torch offers no way to read the
    active hooks); without it the meter would have to know about the offload.
    """
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def tensor_version(t: Tensor) -> int:
    """How many times `t`'s data was modified in place (`Tensor._version`, autograd's
    version counter). Activation offload keys its one-copy-per-tensor cache on it, so a tensor
    saved, modified in place and saved again gets a second copy. Public alternative: none."""
    return t._version
