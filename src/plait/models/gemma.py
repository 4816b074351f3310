"""What Gemma 2 and 3 compute differently from LLaMA, outside attention (whose window, scale
and soft-capped scores are models/core_attention.py's):

- the norm scales by (1 + weight), in fp32 before rounding back (a zero weight is the
  identity; Gemma initializes it so), where LLaMA's rounds first and scales by the weight;
- the block normalizes each sublayer's output too (post-attention and post-feedforward
  norms), so four norms per block (their rows: models/block_table.py);
- the embeddings are multiplied by sqrt(d_model) rounded to their dtype;
- Gemma 2 soft-caps the final logits: tanh(z / cap) · cap.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class GemmaRMSNorm(nn.Module):
    """x / rms(x) · (1 + weight), in fp32, then rounded to x's dtype (Hugging Face's
    Gemma2RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


def scale_embeddings(x: Tensor) -> Tensor:
    """x (b, s, h) · sqrt(h), the factor rounded to x's dtype first (as Gemma's
    `normalizer`), so bf16 runs scale by bf16's sqrt(h)."""
    return x * torch.tensor(x.shape[-1] ** 0.5, dtype=x.dtype)


def softcap(x: Tensor, cap: float | None) -> Tensor:
    """tanh(x / cap) · cap, or x without a cap."""
    return x if cap is None else torch.tanh(x / cap) * cap
