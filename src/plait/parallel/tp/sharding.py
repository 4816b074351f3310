"""Tensor-parallel shards as tensors: cut one from a full tensor, gather one back.

Where a shard sits in its parameter's full tensor is a `ShardSpec` (models/contract.py; made
by `split_spec`). The model's contract records every shard a rank holds, by parameter name,
rather than the Parameter or its module: `Module.to_empty` replaces Parameter objects when a
meta model is materialized, and names survive everything. Parameters without a spec are
whole (replicated over tp). `init_parameters` reads the specs to give each shard exactly its
slice of the single-process value; checkpoints read them to save under one layout and load
under another.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.models.contract import ShardSpec, contract_of, split_spec

__all__ = ["ShardSpec", "full_tensor", "load_shard_", "param_shard_specs", "split_spec"]


@torch.no_grad()
def load_shard_(param: Tensor, full: Tensor, spec: ShardSpec) -> None:
    """Copy `spec`'s slice of the full tensor into `param`; padding becomes zero."""
    param.zero_()
    spec.unpadded(param).copy_(full[spec.region()])


def param_shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """Qualified parameter name -> ShardSpec for every sharded parameter of `model`.

    Names are those of `model.named_parameters()` (a tied weight under its first name).
    """
    return contract_of(model).shards()


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
