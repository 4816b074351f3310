"""Activation recomputation: trade compute for memory by re-running forward during backward.

Modes (Korthikanti et al., 2022):
- none: keep every activation.
- full: keep only each transformer block's input; recompute the whole block in backward.
- selective: recompute only the attention core (softmax(QK^T)V and its dropout), whose
  activations grow with s^2 but cost few FLOPs to redo.

The wrapped module's parameters and names stay unchanged: only the instance's forward is
routed through torch.utils.checkpoint, and the model's contract records which blocks run
under full recomputation (`ModelContract.recomputed`: the pipeline's split backward reads
it). RNG state is saved and restored around the recompute (preserve_rng_state=True), and
plait's keyed dropout is a pure function of its key, so the dropout masks of the recomputed
forward are identical to the original ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.composition import check_recompute
from plait.models.transformer import Block, Transformer


def checkpoint_module(module: nn.Module) -> None:
    """Route `module`'s forward through non-reentrant activation checkpointing."""
    inner: Callable = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    module.forward = forward  # instance attribute: this module only, torch untouched


def apply_recompute(model: Transformer, mode: str) -> list[nn.Module]:
    """Apply `mode` to every block this rank holds; returns the wrapped modules."""
    check_recompute(mode)
    if mode == "none":
        return []
    contract = model.contract
    blocks: list[Block] = [model.get_submodule(part.path) for part in contract.blocks()]
    targets = [blk if mode == "full" else blk.attn.core for blk in blocks]
    for module in targets:
        checkpoint_module(module)
    if mode == "full":
        model.set_contract(contract.recomputing(part.index for part in contract.blocks()))
    return targets
