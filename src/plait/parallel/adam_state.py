"""A torch AdamW over whole parameters, as checkpoint pieces and back.

The engines that keep no ZeRO shards (2BW's weight versions, naive data parallelism's
coordinator) step a `torch.optim.AdamW` whose state is per parameter, whole. Their checkpoint
pieces are therefore whole parameters (start 0, every element), under the same layout-free
names as the ZeRO engine's, so any engine resumes from any other's checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from plait.parallel.zero.state_dict import ParamShardState

MOMENTS = ("exp_avg", "exp_avg_sq")


def whole_pieces(
    names: Sequence[str],
    weights: Sequence[Tensor],
    optimizer: torch.optim.Optimizer,
    keys: Sequence[Tensor],
    extra: Mapping[str, Sequence[Tensor]] | None = None,
) -> list[ParamShardState]:
    """One piece per parameter: `master` (the fp32 weights), the moments the optimizer keeps
    under `keys[i]` (zeros before its first step), and any `extra` per-parameter tensors."""
    pieces = []
    for i, (name, weight) in enumerate(zip(names, weights, strict=True)):
        state = optimizer.state.get(keys[i], {})
        tensors = {"master": weight.detach().reshape(-1).clone()}
        for key in MOMENTS:
            value = state.get(key)
            tensors[key] = torch.zeros(weight.numel()) if value is None else value.reshape(-1)
        for key, values in (extra or {}).items():
            tensors[key] = values[i].detach().reshape(-1).clone()
        pieces.append(ParamShardState(name, tuple(weight.shape), 0, weight.numel(), tensors))
    return pieces


def load_moments(
    optimizer: torch.optim.Optimizer,
    keys: Sequence[Tensor],
    shapes: Sequence[torch.Size],
    saved: Sequence[Mapping[str, Tensor]],
    step: int,
) -> None:
    """Give the optimizer the saved moments of every parameter, `step` steps taken (Adam's
    bias correction continues from it)."""
    for key, shape, state in zip(keys, shapes, saved, strict=True):
        optimizer.state[key] = {"step": torch.tensor(float(step))} | {
            m: state[m].reshape(shape).to(key.device, copy=True) for m in MOMENTS
        }
