"""Rotary position embedding (Su et al., 2021) in Hugging Face LLaMA's rotate-half layout:
the pairs rotated together are (i, i + hd/2), so LLaMA checkpoints need no permutation."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_cos_sin(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    start: int = 0,
    positions: Tensor | None = None,
) -> tuple:
    """cos and sin (s, hd) for positions start..start+s-1, in fp32, rotate-half layout; given
    per-token `positions` (b, s) (packed rows), (b, 1, s, hd) to broadcast over heads.

    Computed on the fly rather than cached in buffers: it is cheap, works on the meta
    device, and leaves nothing for `to_empty` to turn into garbage.
    """
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if positions is None:
        angles = torch.outer(torch.arange(start, start + seq_len, device=device).float(), inv_freq)
    else:  # the same products, per token: (b, 1, s, hd/2)
        angles = (positions.float().unsqueeze(-1) * inv_freq).unsqueeze(1)
    angles = torch.cat((angles, angles), dim=-1)  # (s, hd) or (b, 1, s, hd)
    return angles.cos(), angles.sin()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (b, heads, s, hd) by position; pairs are (i, i + hd/2) as in HF LLaMA."""
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).type_as(x)
