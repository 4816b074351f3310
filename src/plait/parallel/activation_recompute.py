"""Activation recomputation: trade compute for memory by re-running forward during backward.

Modes (Korthikanti et al., 2022):
- none: keep every activation.
- full: keep only each transformer block's input; recompute the whole block in backward.
- selective: recompute only the attention core (softmax(QK^T)V and its dropout), whose
  activations grow with s^2 but cost few FLOPs to redo.

The wrapped module's parameters and names stay unchanged: only the instance's forward is
routed through torch.utils.checkpoint. RNG state is saved and restored around the recompute
(preserve_rng_state=True), and plait's keyed dropout is a pure function of its key, so the
dropout masks of the recomputed forward are identical to the original ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.composition import check_recompute


def checkpoint_module(module: nn.Module) -> None:
    """Route `module`'s forward through non-reentrant activation checkpointing."""
    inner: Callable = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    module.forward = forward  # instance attribute: this module only, torch untouched
    module.recomputed = True  # read by the pipeline's split backward (see split_backward.py)


def apply_recompute(model: nn.Module, mode: str) -> list[nn.Module]:
    """Apply `mode` to every transformer block of `model`; returns the wrapped modules."""
    check_recompute(mode)
    if mode == "none":
        return []
    blocks = [blk for blk in model.blocks if hasattr(blk, "attn")]  # skip other stages' blocks
    targets = [blk if mode == "full" else blk.attn.core for blk in blocks]
    for module in targets:
        checkpoint_module(module)
    return targets
