"""ZeRO on a model that tensor and pipeline parallelism split further: the sums and the norm
that the split adds, done on the engine's gradient shards.

After `ZeroEngine.finish()` a stage >= 1 gradient exists only as this rank's dp shard, so
the per-parameter work that `DataParallel` does on full gradients is done on the pieces of
parameters inside the shard (`ZeroEngine.grad_pieces`). Both sums are linear, so they
commute with the data-parallel average:

- sequence parallelism: a replicated parameter (norm gains, row-parallel biases) sees on
  each tp rank only its sequence shard's gradient; the tp ranks sum them. The tp ranks of
  one dp rank lay out their groups identically (same shapes, same order), so the pieces of
  a shard line up across tp.
- tied embeddings: the first and the last pipeline stage hold a copy each; their gradients
  are summed over the pipeline ends. Each copy is alone in its flat group (`isolate`), so
  both ends shard it identically.

The global norm counts every parameter once: tp shards summed over tp, replicated
parameters on tp rank 0 only, pipeline stages summed over pp, the last stage's tied copy
skipped (the first stage counts the matrix).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.parallel.pipeline.engine import PipelineEngine
from plait.parallel.pipeline.stage import tied_embedding_params
from plait.parallel.tp.grads import grad_norm_groups, sequence_parallel_partial_params
from plait.parallel.zero.engine import ZeroEngine


def isolated_params(model: nn.Module, pipeline: PipelineEngine | None) -> list[nn.Parameter]:
    """The parameters the engine must give a flat group of their own (tied copies)."""
    return tied_embedding_params(model) if pipeline is not None else []


@torch.no_grad()
def sum_shard_pieces(engine: ZeroEngine, params: list[nn.Parameter], axis: str, tag: str) -> None:
    """Sum over `axis`, in place, this rank's shard pieces of `params` (one all-reduce)."""
    comm = engine.comm
    wanted = {id(p) for p in params}
    views = [view for p, _, view in engine.grad_pieces() if id(p) in wanted]
    if not views or comm.mesh.size(axis) == 1:
        return
    flat = torch.cat(views)
    comm.all_reduce(flat, axis, tag=tag)
    for view, part in zip(views, flat.split([v.numel() for v in views]), strict=True):
        view.copy_(part)


def sync_split_grads(engine: ZeroEngine, model: nn.Module, pipeline: PipelineEngine | None) -> None:
    """The tp sequence-parallel sums and the pipeline's tied-embedding sum, on the shards."""
    sum_shard_pieces(engine, sequence_parallel_partial_params(model), "tp", "tp-sp-grads")
    if pipeline is not None:
        sum_shard_pieces(engine, tied_embedding_params(model), "pp_ends", "tied_embedding")


def norm_rules(
    model: nn.Module, comm: Comm, pipeline: PipelineEngine | None
) -> tuple[Callable[[Tensor], Tensor] | None, Callable[[nn.Parameter], float] | None]:
    """(reduce_sq, weight) for `ZeroEngine.clip_grad_norm`; (None, None) when unsplit."""
    if comm.mesh.size("tp") == 1 and pipeline is None:
        return None, None
    skip = {id(p) for p in pipeline.norm_duplicates()} if pipeline else set()
    if comm.mesh.axis_rank("tp") != 0:
        skip |= {id(p) for p in grad_norm_groups(model)[1]}  # replicated: tp rank 0 counts

    def weight(p: nn.Parameter) -> float:
        return 0.0 if id(p) in skip else 1.0

    def reduce_sq(sq: Tensor) -> Tensor:
        comm.all_reduce(sq, "tp", tag="grad_norm")
        if pipeline is not None:
            pipeline.sum_over_stages(sq)
        return sq

    return reduce_sq, weight
