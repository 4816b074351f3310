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

import torch
from torch import nn

from plait.composition import check_activation_offload
from plait.device import HostCopies
from plait.memory_tracker import mark_offloaded
from plait.models.transformer import Block, Transformer
from plait.parallel.saved_tensors import Hooks, grad_leaf, saved_key, wrap_forward
from plait.torch_private import view_base


def _stays(t: torch.Tensor) -> bool:
    """Parameters (frozen ones too, and views of them) and grad-requiring leaves are not
    activations."""
    return isinstance(view_base(t), nn.Parameter) or grad_leaf(t)


def _hooks(x: torch.Tensor, outer: Hooks, copier: HostCopies):
    """Pack and unpack that move a saved tensor to the host and back, through `outer`, and
    what lets go of the cache that makes one host copy of a tensor several nodes save (a
    norm's output, the input of q, k and v). The cache holds the device tensor too, until the
    block's forward ends, so its memory cannot be reused by another tensor with the same key."""
    outer_pack, outer_unpack = outer
    copies: dict[tuple, tuple[torch.Tensor, torch.Tensor, object | None]] = {}

    def pack(t: torch.Tensor):
        if _stays(t):
            return (None, None, outer_pack(t))
        key = saved_key(t)
        if key not in copies:
            host, done = copier.to_host(t.detach())
            copies[key] = (t, mark_offloaded(host), done)
        _, host, done = copies[key]
        return (t.device, done, outer_pack(host))

    def unpack(saved) -> torch.Tensor:
        device, done, inner = saved
        t = outer_unpack(inner)
        return t if device is None else copier.from_host(t, done, device)

    return pack, unpack, copies.clear


def offload_module(module: nn.Module, copier: HostCopies) -> None:
    """Run `module`'s forward (recompute wrapper included) under the offload hooks, copying
    with `copier` (on a GPU its side stream, shared by the rank's blocks)."""
    wrap_forward(module, lambda x, outer: _hooks(x, outer, copier))


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
