"""Running a block's forward under its own saved-tensor hooks, chained to the outer ones.

Activation offload (the saved tensors to the host) and partitioned activations (the block's
input 1/tp per rank) both change what a block keeps for its backward, and both must leave
the hooks around the step (the memory tracker's meter) seeing what is kept: one wraps the
other, and the meter wraps both. This module is what they share: the forward wrapper that
installs a pair of hooks for one forward and lets its cache go after, and how a saved tensor
is recognised when several graph nodes save it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from plait.torch_private import outer_saved_tensors_hooks, tensor_version, view_base

Hooks = tuple[Callable, Callable]
"""A (pack, unpack) pair as `torch.autograd.graph.saved_tensors_hooks` takes it."""

MakeHooks = Callable[[Tensor, Hooks], tuple[Callable, Callable, Callable[[], None]]]
"""Given the block's first argument and the outer (pack, unpack) pair (identities when none
is active): this forward's pack, unpack and what to let go when the forward ends."""


def saved_key(t: Tensor) -> tuple:
    """One tensor, as several nodes save it: its memory, dtype, shape, strides and version
    (a tensor saved, modified in place and saved again is another tensor)."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), tensor_version(t))


def grad_leaf(t: Tensor) -> bool:
    """Whether `t` (or the tensor it views) is a leaf that requires grad: a parameter that
    trains, or a pipeline stage's received input, which its owner keeps anyway."""
    base = view_base(t)
    return base.is_leaf and base.requires_grad


def wrap_forward(module: nn.Module, make: MakeHooks) -> None:
    """Run `module`'s forward (a recompute wrapper included) under the hooks `make` builds
    for each forward that records a graph, chained to the hooks active outside it."""
    inner: Callable = module.forward

    def forward(x, *args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(x, *args, **kwargs)
        outer = outer_saved_tensors_hooks() or (lambda t: t, lambda t: t)
        pack, unpack, done = make(x, outer)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return inner(x, *args, **kwargs)
        finally:
            done()

    module.forward = forward  # instance attribute: this module only, torch untouched
