"""The norms of a block: LayerNorm (GPT-2), RMSNorm (LLaMA and its kin) over the residual
stream, and the per-head RMSNorms some families put on q and k (Qwen3), which the block
table declares (models/block_table.py `NormRow.over`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from plait.models.architecture import ModelConfig
from plait.models.block_table import block_table
from plait.models.gemma import GemmaRMSNorm


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich, 2019), as LLaMA; computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def make_norm(cfg: ModelConfig) -> nn.Module:
    """A norm over the residual stream's d_model features (Gemma's scales by 1 + w)."""
    if cfg.gemma:
        return GemmaRMSNorm(cfg.d_model, cfg.norm_eps)
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def head_norms(cfg: ModelConfig) -> tuple[nn.Module | None, nn.Module | None]:
    """The RMSNorms over each head of q and of k (head_dim features, applied before RoPE)
    when the block table has them (Qwen3's q_norm and k_norm; Gemma 3's, of its (1 + w)
    kind), else None."""
    norms = {r.path for r in block_table(cfg).norms}
    kind = GemmaRMSNorm if cfg.gemma else RMSNorm
    return tuple(  # type: ignore[return-value]
        kind(cfg.head_dim, cfg.norm_eps) if f"attn.{name}" in norms else None
        for name in ("q_norm", "k_norm")
    )
