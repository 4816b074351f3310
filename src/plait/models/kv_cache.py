"""Keys and values of the positions already decoded, so generation computes each token once.

Training never passes a cache; with one, attention appends this call's keys and values to the
layer's and attends from the new positions to every position so far (Pope et al.,
Efficiently Scaling Transformer Inference, 2022, section 2).
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Per layer: keys and values (b, kv, t, hd) of the first `length` positions."""

    def __init__(self) -> None:
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.length = 0  # positions every layer holds; the next call starts here

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this call's (b, kv, s, hd) keys and values; returns the layer's all."""
        if layer in self.keys:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v  # (b, kv, t + s, hd)

    def advance(self, s: int) -> None:
        """Every layer has taken `s` more positions (called once per model forward)."""
        self.length += s


def causal_mask(start: int, s: int, device: torch.device, window: int | None = None) -> Tensor:
    """(s, start + s) bool: new position start + i sees positions 0 .. start + i, or with a
    `window` only the last `window` of them (start + i - window < j)."""
    mask = torch.ones(s, start + s, dtype=torch.bool, device=device).tril(diagonal=start)
    if window is not None:
        mask = mask.triu(diagonal=start - window + 1)
    return mask
