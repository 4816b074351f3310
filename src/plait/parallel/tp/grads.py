"""Gradients under tensor parallelism: which are partial, which are shards, the global norm.

Three kinds of parameters after `apply_tensor_parallel`:

- sharded (a `param_shards` entry): each rank owns a disjoint slice and its full gradient;
- replicated, complete: without sequence parallelism every replicated parameter (norms,
  row-parallel biases, positions) sees the whole sequence on every rank and gets the same,
  complete gradient everywhere (f's backward all-reduce already summed what flows into it);
- replicated, partial (a `tp_partial_grads` entry): under sequence parallelism the same
  parameters see only this rank's positions, so each rank holds a partial gradient and
  the true one is their sum over tp.

`sync_sequence_parallel_grads` sums the partial ones (one all-reduce of a flat buffer);
`grad_norm_groups` and `tp_grad_norm` give the single-process gradient norm: squares of
shards summed over tp, replicated parameters counted once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from plait.comm import Comm


def _owned(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
    """(module, local name, parameter) for every unique parameter of `model`."""
    seen: set[int] = set()
    for module in model.modules():
        for leaf, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield module, leaf, param


def sequence_parallel_partial_params(model: nn.Module) -> list[nn.Parameter]:
    """Replicated parameters whose gradient each tp rank sees only for its sequence shard.

    Empty without sequence parallelism. Order is the model's module order (the same on
    every rank, so the flat buffers line up).
    """
    return [p for m, leaf, p in _owned(model) if leaf in getattr(m, "tp_partial_grads", ())]


@torch.no_grad()
def sync_sequence_parallel_grads(model: nn.Module, comm: Comm) -> None:
    """Sum the partial gradients of `sequence_parallel_partial_params` over tp, in place.

    Call once per optimizer step after the last micro-batch's backward, before clipping
    and the optimizer step. It commutes with the data-parallel average (both are linear),
    so it may run before or after the dp reduction; `p.grad` may be a view into a dp
    bucket. One all-reduce of a flat buffer (tag "tp-sp-grads").
    """
    grads = [p.grad for p in sequence_parallel_partial_params(model) if p.grad is not None]
    comm.all_reduce_flat(grads, "tp", tag="tp-sp-grads")


def grad_norm_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(sharded over tp, replicated over tp): squares of the first are summed over tp ranks,
    the second counted once, for the global gradient norm. Padding gradients are zero.
    """
    sharded, replicated = [], []
    for module, leaf, param in _owned(model):
        (sharded if leaf in getattr(module, "param_shards", {}) else replicated).append(param)
    return sharded, replicated


def tp_grad_norm(model: nn.Module, comm: Comm) -> Tensor:
    """Global L2 norm of the gradients, equal to the single-process model's (fp32 scalar).

    Assumes partial gradients were already synced. One scalar all-reduce over tp
    (tag "tp-norm"). Under data parallelism the gradients are identical across replicas
    after their reduction, so no dp communication is needed.
    """
    sharded, replicated = grad_norm_groups(model)
    device = next(model.parameters()).device

    def squares(params: list[nn.Parameter]) -> Tensor:
        total = torch.zeros((), dtype=torch.float32, device=device)
        for p in params:
            if p.grad is not None:
                total += p.grad.float().pow(2).sum()
        return total

    shard_sq = squares(sharded)
    comm.all_reduce(shard_sq, "tp", tag="tp-norm")
    return (shard_sq + squares(replicated)).sqrt()


@torch.no_grad()
def clip_tp_grad_norm_(model: nn.Module, comm: Comm, max_norm: float) -> float:
    """Scale gradients so their global norm is at most `max_norm`; returns the norm.

    torch.nn.utils.clip_grad_norm_'s rule: coefficient max_norm / (norm + 1e-6), capped at 1.
    """
    norm = tp_grad_norm(model, comm)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return float(norm)
