"""The global gradient norm of a model split across ranks, equal to the single process's.

Each parameter's squared gradient is counted exactly once in the whole model: tensor-parallel
shards are summed over tp (each rank owns a disjoint slice), parameters replicated over tp
are counted once, pipeline stages are summed over pp, and the last stage's copy of a tied
embedding is skipped (the first stage counts it). Data-parallel replicas hold identical
gradients after their reduction, so dp needs no communication here.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.parallel.data_parallel import DataParallel
from plait.parallel.pipeline.engine import PipelineEngine
from plait.parallel.tp.grads import grad_norm_groups


def _squares(params: list[nn.Parameter], skip: set[int], device: torch.device) -> Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is not None and id(p) not in skip:
            total += p.grad.float().pow(2).sum()
    return total


def global_grad_norm(
    model: nn.Module, dp: DataParallel, comm: Comm, pipeline: PipelineEngine | None
) -> Tensor:
    """L2 norm of the whole model's gradient (call after the gradients are reduced)."""
    if comm.mesh.size("tp") == 1 and pipeline is None:  # the whole model is here: flat buffers
        return torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in dp.grad_buffers()])
        )
    skip = {id(p) for p in pipeline.norm_duplicates()} if pipeline else set()
    sharded, replicated = grad_norm_groups(model)
    shard_sq = _squares(sharded, skip, comm.mesh.device)
    comm.all_reduce(shard_sq, "tp", op="sum", tag="grad_norm")
    total = shard_sq + _squares(replicated, skip, comm.mesh.device)
    if pipeline is not None:
        pipeline.sum_over_stages(total)
    return total.sqrt()
