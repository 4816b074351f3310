"""plait's one AdamW: element-wise on flat fp32 slices, so any slice of the parameters can be
updated alone. Every optimizer engine steps it: the ZeRO engine over its shards
(`zero/engine.py`), 2BW's weight versions and naive data parallelism's coordinator over whole
parameters (`whole_adamw.py`).

Adam (Kingma & Ba, 2015) with decoupled weight decay (Loshchilov & Hutter, 2019) is purely
element-wise: each element's update depends on its own gradient and moments only. That is
what lets ZeRO give each rank an arbitrary 1/N slice of a flat buffer, cutting through the
middle of a matrix, and still compute exactly the step an unsharded optimizer computes.

The operations mirror torch.optim.AdamW's single-tensor path one for one (lerp_ for the
first moment, mul_/addcmul_ for the second, the same bias-correction arithmetic), so on the
same inputs the results are bitwise identical; tests check that against torch
(`tests/test_adamw.py`). Which parameters decay is one rule, `decays`, shared with the torch
AdamW that references and peers build (`plait.optim.build_optimizer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from plait.config import OptimConfig


def decays(param: nn.Parameter) -> bool:
    """Whether `param` gets weight decay: matrices and embeddings do; biases and norm gains
    (vectors) stay unregularized, as in GPT-2's and nanoGPT's training."""
    return param.dim() >= 2


class ElementwiseOptimizer(Protocol):
    """What the sharded engine needs of an optimizer: named per-element states and an
    in-place update of one flat slice. Any element-wise rule (SGD, Adam, Lion) fits."""

    state_names: tuple[str, ...]

    def update(
        self,
        param: Tensor,
        grad: Tensor,
        states: dict[str, Tensor],
        step: int,
        lr: float,
        decay: list[tuple[int, int]],
    ) -> None: ...


@dataclass(frozen=True)
class AdamW:
    """Hyper-parameters of AdamW; `update` applies one step to a flat slice in place."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    state_names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")

    @classmethod
    def from_optim(cls, cfg: OptimConfig) -> AdamW:
        """The run's hyper-parameters (the same `plait.optim.build_optimizer` gives torch's)."""
        return cls(cfg.beta1, cfg.beta2, 1e-8, cfg.weight_decay)

    @torch.no_grad()
    def update(
        self,
        param: Tensor,
        grad: Tensor,
        states: dict[str, Tensor],
        step: int,
        lr: float,
        decay: list[tuple[int, int]],
    ) -> None:
        """One AdamW step on `param` (fp32, flat); `decay` lists the (start, end) ranges that
        get weight decay (matrices; not biases or norm gains); `step` counts from 1."""
        exp_avg, exp_avg_sq = states["exp_avg"], states["exp_avg_sq"]
        if self.weight_decay != 0:
            shrink = 1 - lr * self.weight_decay
            for start, end in decay:
                param[start:end].mul_(shrink)
        exp_avg.lerp_(grad, 1 - self.beta1)
        exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        bias_correction1 = 1 - self.beta1**step
        bias_correction2 = 1 - self.beta2**step
        step_size = lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def clip_segments(segments: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """`segments` restricted to [start, end) and shifted to start at 0 (for a sub-group)."""
    out = []
    for a, b in segments:
        lo, hi = max(a, start), min(b, end)
        if lo < hi:
            out.append((lo - start, hi - start))
    return out
