"""Sharding metadata: where a tensor-parallel shard sits in its parameter's full tensor.

Each sharded parameter's owning module carries `param_shards: dict[str, ShardSpec]` (keyed
by the parameter's local name). The metadata lives on the module rather than the Parameter
because `Module.to_empty` replaces Parameter objects when a meta model is materialized,
dropping any attribute set on them; modules survive. Parameters without a spec are whole
(replicated over tp). `init_parameters` reads the specs to give each shard exactly its slice
of the single-process value; a checkpoint format can read them to save under one layout and
load under another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.errors import ConfigError


@dataclass(frozen=True)
class ShardSpec:
    """A local tensor as the slice of a full parameter along one dimension.

    The local tensor holds `full[offsets[d] : offsets[d] + local_shape[d]]` followed, along
    `dim`, by `padding` zero elements that exist only so every rank's tensor has the same
    shape (a vocabulary not divisible by tp). Padding is never part of the parameter.
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    dim: int
    padding: int = 0
    axis: str = "tp"

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the local tensor, padding included."""
        shape = list(self.local_shape)
        shape[self.dim] += self.padding
        return tuple(shape)

    def region(self) -> tuple[slice, ...]:
        """Index of this shard's real data in the full tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local_shape, strict=True))

    def unpadded(self, local: Tensor) -> Tensor:
        """The real data of a local tensor (what an exported checkpoint must contain)."""
        return local.narrow(self.dim, 0, self.local_shape[self.dim])


def split_spec(
    global_shape: tuple[int, ...], dim: int, rank: int, size: int, pad: bool = False, what: str = ""
) -> ShardSpec:
    """Rank `rank` of `size` holds a contiguous 1/size of `global_shape` along `dim`.

    With `pad`, a length not divisible by `size` is rounded up to a multiple of it and the
    missing elements become padding at the end of the last shards; without, it is an error.
    """
    n = global_shape[dim]
    if n % size and not pad:
        raise ConfigError(f"{what or 'dimension'}={n} is not divisible by tp={size}")
    per = math.ceil(n / size)
    start = rank * per
    real = max(0, min(per, n - start))
    offsets = [0] * len(global_shape)
    offsets[dim] = min(start, n)
    local = list(global_shape)
    local[dim] = real
    return ShardSpec(tuple(global_shape), tuple(offsets), tuple(local), dim, per - real)


@torch.no_grad()
def load_shard_(param: Tensor, full: Tensor, spec: ShardSpec) -> None:
    """Copy `spec`'s slice of the full tensor into `param`; padding becomes zero."""
    param.zero_()
    spec.unpadded(param).copy_(full[spec.region()])


def param_shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """Qualified parameter name -> ShardSpec for every sharded parameter of `model`.

    Names are those of `model.named_parameters()` (a tied weight under its first name).
    """
    by_id: dict[int, ShardSpec] = {}
    for module in model.modules():
        for leaf, spec in getattr(module, "param_shards", {}).items():
            param = getattr(module, leaf)
            by_id.setdefault(id(param), spec)
    return {name: by_id[id(p)] for name, p in model.named_parameters() if id(p) in by_id}


@torch.no_grad()
def full_tensor(local: Tensor, spec: ShardSpec, comm: Comm, tag: str = "tp-gather") -> Tensor:
    """Gather every rank's shard into the full tensor (padding dropped); all tp ranks call it.

    Padding only ever sits after the last real element, so the gathered tensor's first
    `global_shape[dim]` entries along `dim` are the full parameter.
    """
    n = comm.mesh.size(spec.axis)
    t = local.detach().movedim(spec.dim, 0).contiguous()
    out = t.new_empty((n * t.shape[0], *t.shape[1:]))
    comm.all_gather(out, t, spec.axis, tag=tag)
    return out[: spec.global_shape[spec.dim]].movedim(0, spec.dim).contiguous()
