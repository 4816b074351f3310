"""Activation offload: the tensors a block saves for backward wait in host memory.

With `--offload-activations cpu` every transformer block this rank holds runs its forward
under a pair of saved-tensor hooks: pack copies each saved tensor to host memory (the
device copy is then free as soon as the forward drops it), unpack copies it back when
backward needs it. Only the blocks: the embedding, the final norm, the output layer and the
loss keep theirs on the device. Copies are exact, so the run is bitwise the one without
offload. Combined with full recomputation, the block saves only its input (the checkpoint)
and so only that moves: DeepSpeed's CPU checkpointing. How a copy is made (on a GPU pinned
memory, a side stream and events, so the copy overlaps the forward) is `plait.device`'s
business (`HostCopies`).

Parameters and views of them, and leaves that require grad, are not activations and stay
where they are (as the memory tracker's meter skips them). The hooks chain to whatever
hooks were active outside the block (the meter's), handing them the host copy marked as
offloaded, so the meter counts it in place host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait.composition import check_activation_offload
from plait.device import HostCopies
from plait.memory_tracker import mark_offloaded
from plait.models.transformer import Block, Transformer
from plait.torch_private import outer_saved_tensors_hooks, tensor_version, view_base


def _stays(t: torch.Tensor) -> bool:
    """Parameters (and views of them) and grad-requiring leaves are not activations."""
    base = view_base(t)
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


def _hooks(
    outer: tuple[Callable, Callable] | None, copier: HostCopies
) -> tuple[Callable, Callable, dict]:
    """Pack and unpack that move a saved tensor to the host and back, through `outer`, and
    the cache that makes one host copy of a tensor several nodes save (a norm's output,
    the input of q, k and v). The cache holds the device tensor too, until the block's
    forward ends, so its memory cannot be reused by another tensor with the same key."""
    outer_pack, outer_unpack = outer or (lambda t: t, lambda t: t)
    copies: dict[tuple, tuple[torch.Tensor, torch.Tensor, object | None]] = {}

    def pack(t: torch.Tensor):
        if _stays(t):
            return (None, None, outer_pack(t))
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), tensor_version(t))
        if key not in copies:
            host, done = copier.to_host(t.detach())
            copies[key] = (t, mark_offloaded(host), done)
        _, host, done = copies[key]
        return (t.device, done, outer_pack(host))

    def unpack(saved) -> torch.Tensor:
        device, done, inner = saved
        t = outer_unpack(inner)
        return t if device is None else copier.from_host(t, done, device)

    return pack, unpack, copies


def offload_module(module: nn.Module, copier: HostCopies) -> None:
    """Run `module`'s forward (recompute wrapper included) under the offload hooks, copying
    with `copier` (on a GPU its side stream, shared by the rank's blocks)."""
    inner: Callable = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        pack, unpack, copies = _hooks(outer_saved_tensors_hooks(), copier)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return inner(*args, **kwargs)
        finally:
            copies.clear()

    module.forward = forward  # instance attribute: this module only, torch untouched


def apply_activation_offload(model: Transformer, target: str) -> list[nn.Module]:
    """Offload the saved tensors of every block this rank holds to `target` (call after
    `apply_recompute`, so the checkpoint's saved input is what moves); the wrapped blocks.
    2BW calls it on each of its weight versions' copies (their blocks are other modules)."""
    check_activation_offload(target)
    if target == "none":
        return []
    blocks: list[Block] = [model.get_submodule(p.path) for p in model.contract.blocks()]
    copier = HostCopies(next(model.parameters()).device)
    for block in blocks:
        offload_module(block, copier)
    return blocks
