"""How a context-parallel rank reaches the keys and values the other ranks hold.

allgather: one all-gather of the layer's K and V together over cp (the rank's local
queries then meet every key of the row under its rows of the block-causal rule); backward
reduce-scatters their gradients, so each rank gets dK and dV for the tokens it holds,
summed over every rank's queries. Per layer and micro-batch the comm layer counts
2·b·s·kv·hd elements each way (the gathered buffer, its logical size); of it
(cp−1)/cp arrives from the other ranks: 2·b·s·kv·hd·(cp−1)/cp, the textbook figure.
"""

from __future__ import annotations

import torch
from torch import Tensor

from plait.comm import Comm


class GatherKV(torch.autograd.Function):
    """(k, v) (b, kv, L, hd) -> every rank's, (b, kv, cp·L, hd) in rank order."""

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, comm: Comm) -> tuple[Tensor, Tensor]:
        cp = comm.mesh.size("cp")
        local = torch.stack([k, v]).contiguous()  # (2, b, kv, L, hd)
        out = local.new_empty(cp * local.numel())
        comm.all_gather(out, local.view(-1), "cp", tag="cp_kv")
        ctx.comm, ctx.shape = comm, local.shape
        return _rows(out.view(cp, *local.shape))

    @staticmethod
    def backward(ctx, grad_k: Tensor, grad_v: Tensor):
        cp = ctx.comm.mesh.size("cp")
        _, b, kv, length, hd = ctx.shape
        both = torch.stack([grad_k, grad_v])  # (2, b, kv, cp·L, hd)
        both = both.view(2, b, kv, cp, length, hd).permute(3, 0, 1, 2, 4, 5).contiguous()
        out = both.new_empty(ctx.shape)  # (2, b, kv, L, hd)
        ctx.comm.reduce_scatter(out.view(-1), both.view(-1), "cp", tag="cp_kv_grad")
        return out[0], out[1], None


def _rows(gathered: Tensor) -> tuple[Tensor, Tensor]:
    """(cp, 2, b, kv, L, hd) -> k and v (b, kv, cp·L, hd): rank r's tokens at r·L.."""
    cp, _, b, kv, length, hd = gathered.shape
    both = gathered.permute(1, 2, 3, 0, 4, 5).reshape(2, b, kv, cp * length, hd)
    return both[0], both[1]


def gather_kv(k: Tensor, v: Tensor, comm: Comm) -> tuple[Tensor, Tensor]:
    """Every cp rank's keys and values of the layer, gradients sent back to their owners."""
    return GatherKV.apply(k, v, comm)
