"""Ring attention: keys and values passed rank to rank, partial results merged exactly.

Each rank starts with its own K and V; at every one of cp turns it attends its queries to
the block it holds (under its rows of the block-causal rule, by place in the row), merges
the block's result into what it has by log-sum-exp (fp32), and passes the block on to the
next rank while receiving the previous rank's. After cp turns every query met every key.
The merge: with m = logaddexp(lse, lse_block), out = out·e^(lse−m) + out_block·e^(lse_block−m)
— softmax over the union of the blocks, computed blockwise (Milakov and Gimelshein, 2018;
Liu et al., Ring Attention, 2023).

Backward goes round the ring once more with each block's dK and dV travelling beside it:
each rank adds its queries' share (from the saved output and log-sum-exp: P = e^(S−lse),
dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O))), and a last pass hands each block's sums to its owner.
Forward sends (cp−1) blocks of 2·b·kv·L·hd elements, the all-gather's (cp−1)/cp of
2·b·s·kv·hd; backward (cp−1) blocks with their fp32 dK, dV and the last dK, dV.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from plait.comm import Comm


def _pass(comm: Comm, tensors: list[Tensor], tag: str) -> list[Tensor]:
    """Send `tensors` to the next cp rank and receive the previous rank's, in their shapes."""
    cp, me = comm.mesh.size("cp"), comm.mesh.axis_rank("cp")
    got = [torch.empty_like(t) for t in tensors]
    ops = [("send", t, (me + 1) % cp) for t in tensors]
    ops += [("recv", g, (me - 1) % cp) for g in got]
    comm.p2p(ops, axis="cp", tag=tag).wait()
    return got


def _scores(q: Tensor, k: Tensor, sees: Tensor) -> Tensor:
    """fp32 scores (b, a, L, L) of q against one block's keys (heads repeated to q's),
    -inf where the rule `sees` (b, 1, L, L) hides a key."""
    s = (q.float() @ k.float().transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return s.masked_fill(~sees, float("-inf"))


def _fold(grad: Tensor, kv: int) -> Tensor:
    """Gradient over repeated heads (b, a, L, hd) summed back to the kv heads they copy."""
    b, a, length, hd = grad.shape
    return grad.view(b, kv, a // kv, length, hd).sum(2)


class RingAttention(torch.autograd.Function):
    """q (b, a, L, hd), k and v (b, kv, L, hd) of this rank; `sees(j)` this rank's rows of
    the rule against rank j's tokens (b, 1, L, L). Returns (b, a, L, hd)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sees, comm: Comm) -> Tensor:
        cp, me = comm.mesh.size("cp"), comm.mesh.axis_rank("cp")
        rep = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)  # (b, a, L)
        block = [k.contiguous(), v.contiguous()]
        for turn in range(cp):
            j = (me - turn) % cp  # whose block this rank holds now
            s = _scores(q, block[0].repeat_interleave(rep, 1), sees(j))
            block_lse = s.logsumexp(-1)  # (b, a, L); -inf where no key of the block is seen
            prev = lse.unsqueeze(-1)
            lse = torch.logaddexp(lse, block_lse)
            base = torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1)  # no key seen yet: 0
            keep = (prev - base).exp()  # 0 where nothing was merged before
            take = (s - base).exp()  # (b, a, L, L): 0 where hidden
            out = out * keep + take @ block[1].repeat_interleave(rep, 1).float()
            if turn < cp - 1:
                block = _pass(comm, block, "cp_ring_kv")
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.sees, ctx.comm = sees, comm
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        comm, sees = ctx.comm, ctx.sees
        cp, me = comm.mesh.size("cp"), comm.mesh.axis_rank("cp")
        kv, rep, scale = k.shape[1], q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
        d_out = grad.float()
        d = (d_out * out).sum(-1, keepdim=True)  # (b, a, L, 1): rowsum(dO ∘ O)
        dq = torch.zeros_like(out)
        block = [k.contiguous(), v.contiguous()]
        d_block = [torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device)]
        for turn in range(cp):
            j = (me - turn) % cp
            kk, vv = (t.repeat_interleave(rep, 1).float() for t in block)
            p = (_scores(q, kk, sees(j)) - lse.unsqueeze(-1)).exp()  # (b, a, L, L)
            ds = p * (d_out @ vv.transpose(-2, -1) - d)
            dq += (ds @ kk) * scale
            d_block[0] += _fold((ds.transpose(-2, -1) @ q.float()) * scale, kv)
            d_block[1] += _fold(p.transpose(-2, -1) @ d_out, kv)
            if turn < cp - 1:
                both = _pass(comm, block + d_block, "cp_ring_back")
                block, d_block = both[:2], both[2:]
        if cp > 1:  # the block held last is rank me+1's: its sums go home
            d_block = _pass(comm, d_block, "cp_ring_home")
        return dq.to(q.dtype), d_block[0].to(k.dtype), d_block[1].to(v.dtype), None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, sees, comm: Comm) -> Tensor:
    """Attention of this rank's queries over every cp rank's keys, passed round a ring."""
    return RingAttention.apply(q, k, v, sees, comm)
