"""The warmup + cosine learning-rate schedule every step follows, and torch's AdamW with plait's
parameter groups for the single-process references and the torch peers (tests, lessons,
benchmarks). No engine steps torch's AdamW: they all step plait's own (`parallel/adamw.py`),
which decays the same parameters (`decays`). Clipping by the global norm: `parallel/grads.py`."""

from __future__ import annotations

import math

import torch
from torch import nn

from plait.config import TrainConfig
from plait.parallel.adamw import decays


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Decay matrices and embeddings only: biases and norm gains stay unregularized. Frozen
    parameters are in no group (no state)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if decays(p)]
    no_decay = [p for p in trainable if not decays(p)]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then cosine decay to `min_lr` at the end."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
