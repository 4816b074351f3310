"""Rotary position embedding (Su et al., 2021) in Hugging Face LLaMA's rotate-half layout:
the pairs rotated together are (i, i + hd/2), so LLaMA checkpoints need no permutation.

Llama 3.1 onwards rescales the frequencies (`Llama3Scaling`, Hugging Face's rope_type
"llama3"): the long wavelengths, above original_max / low_freq_factor, are divided by
`factor` (stretched to the longer context), the short ones, below original_max /
high_freq_factor, are kept, and those between blend the two linearly in original_max /
wavelength."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3's RoPE rescale (Hugging Face's `rope_parameters` of rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max: int  # the pretraining context, original_max_position_embeddings

    def apply(self, inv_freq: Tensor) -> Tensor:
        """The rescaled inverse frequencies (fp32), in transformers' order of operations."""
        wavelen = 2 * math.pi / inv_freq
        long = wavelen > self.original_max / self.low_freq_factor
        short = wavelen < self.original_max / self.high_freq_factor
        scaled = torch.where(long, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        return torch.where(~short & ~long, blended, scaled)


def inverse_frequencies(
    head_dim: int, theta: float, device: torch.device, scaling: Llama3Scaling | None = None
) -> Tensor:
    """theta^(-2i/hd) for i < hd/2 (fp32); rescaled as Llama 3 does given `scaling`, whose
    reference computes 1 / theta^(2i/hd) (the last bit can differ, so that form here)."""
    exponents = torch.arange(0, head_dim, 2, device=device).float() / head_dim
    if scaling is None:
        return theta**-exponents
    return scaling.apply(1.0 / theta**exponents)


def rope_cos_sin(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    start: int = 0,
    positions: Tensor | None = None,
    scaling: Llama3Scaling | None = None,
) -> tuple:
    """cos and sin (s, hd) for positions start..start+s-1, in fp32, rotate-half layout; given
    per-token `positions` (b, s) (packed rows), (b, 1, s, hd) to broadcast over heads.

    Computed on the fly rather than cached in buffers: it is cheap, works on the meta
    device, and leaves nothing for `to_empty` to turn into garbage.
    """
    inv_freq = inverse_frequencies(head_dim, theta, device, scaling)
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
