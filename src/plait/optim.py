"""The learning-rate schedule every step follows (linear warmup, then cosine, linear or
constant decay), and torch's AdamW with plait's parameter groups for the single-process
references and the torch peers (tests, lessons, benchmarks). No engine steps torch's AdamW:
they all step plait's own (`parallel/adamw.py`), which decays the same parameters
(`decays`). Clipping by the global norm: `parallel/grads.py`."""

from __future__ import annotations

import math

import torch
from torch import nn

from plait.config import LR_SCHEDULES, OptimConfig
from plait.parallel.adamw import decays


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
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


def lr_at(step: int, cfg: OptimConfig, steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based) of a run of `steps`.

    Warmup: `lr * (step + 1) / warmup_steps`, so the first step already learns and step
    `warmup_steps - 1` runs at the peak; transformers' schedulers give `lr * step / warmup`
    (the first step at 0), one step behind. After it the decay is transformers' formula for
    the same step, with progress p = (step - warmup) / (steps - warmup), from `lr` to
    `min_lr` (transformers decays to 0: `min_lr = 0` is its schedule exactly):
    cosine `min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2`, linear `min_lr + (lr - min_lr) *
    (1 - p)`, constant `lr`. Past the last step the rate stays at its end."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}")
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.lr_schedule == "linear":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1.0 - progress)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
