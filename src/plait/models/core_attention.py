"""The attention core: softmax(scale · q kᵀ, soft-capped, + mask) v, with keyed dropout.

Parameter-free and separate so that selective recomputation can wrap exactly the part whose
activations (b, a, s, s) dominate memory (Korthikanti et al., 2022). What a family changes
here is per layer and fixed by the config (models/architecture.py):

- `window`: a position attends to the last `window` positions, itself included (Hugging
  Face's sliding window: key j is seen from query i when i - window < j <= i; Mistral v0.1
  every layer, Gemma's local layers), on every path: the causal mask, packed rows' mask, per
  document, varlen and the KV cache;
- `scale`: the factor of q kᵀ (default 1/sqrt(hd); Gemma's query_pre_attn_scalar^-1/2);
- `softcap`: Gemma 2's tanh(scores / cap) · cap before the mask, which no fused kernel
  computes, so the scores are materialized (the explicit path), as Hugging Face's eager
  attention does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.models.dropout import KeyedDropout
from plait.models.kv_cache import causal_mask
from plait.models.packing import Bound, Packing


class CoreAttention(nn.Module):
    """softmax(q kᵀ · scale + causal) v with dropout on the probabilities.

    `mask` (b, 1, s, s), packed rows' block-causal mask as an additive float mask (0 where a
    query may see a key, -inf elsewhere: `Packing.additive`), replaces the causal mask; a
    Packing attends within its documents instead (`Packing.attend`:
    models/packed_attention.py); None keeps SDPA's is_causal kernel (with a window, the
    windowed causal mask). Every layer gets the same mask tensor, so what SDPA saves of it is
    one storage; the explicit path adds it (what masked_fill with -inf gives), and an addition
    saves nothing for backward.
    """

    def __init__(
        self,
        p: float,
        site: int,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.drop = KeyedDropout(p, site)
        self.window, self.scale, self.softcap = window, scale, softcap

    @property
    def explicit(self) -> bool:
        """Whether the forward takes the explicit path: keyed dropout on the probabilities
        (training, p > 0) or soft-capped scores."""
        return (self.training and self.drop.p > 0) or self.softcap is not None

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, keys: Tensor | None, mask: Bound = None
    ) -> Tensor:
        if isinstance(mask, Packing):  # packed rows by document (never explicit)
            return mask.attend(q, k, v, self.window, self.scale)  # (b, a, s, hd)
        if mask is None and self.window is not None:
            mask = causal_mask(0, q.shape[-2], q.device, self.window)  # (s, s) bool
        if not self.explicit:
            if mask is not None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        # Explicit path: the fused kernel's dropout uses torch's RNG, which is not keyed.
        if mask is None:
            mask = causal_mask(0, q.shape[-2], q.device)
        return self.drop(self.probs(q, k, mask), keys) @ v  # (b, a, s, hd)

    def probs(self, q: Tensor, k: Tensor, mask: Tensor) -> Tensor:
        """softmax over keys of the scaled (and soft-capped) scores, (b, a, s, t) in q's
        dtype; `mask` boolean (True = sees) or additive (0 or -inf)."""
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        scores = (q @ k.transpose(-2, -1)) * scale  # (b, a, s, t)
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask  # -inf where hidden, as masked_fill; 0 leaves the score
        return scores.float().softmax(dim=-1).type_as(q)  # (b, a, s, t)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """Generation (no dropout): new positions start.. see every cached one their window
        allows; q (b, a, s, hd), k and v (b, a, start + s, hd)."""
        mask = causal_mask(start, q.shape[-2], q.device, self.window)  # (s, start + s)
        if self.softcap is not None:
            return self.probs(q, k, mask) @ v
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
