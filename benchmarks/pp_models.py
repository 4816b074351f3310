"""The model pieces of `bench_pp.py`: what torch's pipeline stages run, and the fixed-cost
stand-in model whose blocks take a set wall time.

`TorchStage` wraps one global stage of a (pruned) plait model as the plain module
`torch.distributed.pipelining.PipelineStage` expects. The fixed-cost model (`FixedModel`)
has the attributes plait's `run_stage`/`prune_to_stages` use, and blocks whose forward,
input-gradient and weight-gradient backward each burn a fixed time, so a pipeline's compute
cost is controlled and its measured bubble can be set next to the simulator's.
"""

from __future__ import annotations

import time

import torch
from torch import nn


# ---------------------------------------------------------------- torch stage modules
class TorchStage(nn.Module):
    """One global stage of a (pruned) plait model as a plain module for PipelineStage.

    Holds the very submodules plait's `run_stage` would call for this stage: the embedding on
    the first stage, the kept blocks, the final norm and head on the last (which returns
    logits; the schedule's loss_fn applies the model's own loss)."""

    def __init__(self, model: nn.Module, plan) -> None:
        super().__init__()
        self.first, self.last = plan.first, plan.last
        self.embed = model.embed if plan.first else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in plan.layers)
        self.norm = model.norm if plan.last else None
        self.head = model.head if plan.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)  # (b, s, h)
        for block in self.blocks:
            x = block(x)  # (b, s, h)
        return self.head(self.norm(x)) if self.last else x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean token cross-entropy in fp32 that `Transformer.output` computes (used where the
    model has no `loss` submodule)."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------- fixed-cost stand-in model
def burn(seconds: float, mode: str) -> None:
    """Take `seconds` of wall time: sleep (leaves the core to gloo) and spin the last 0.3 ms for
    precision, or spin throughout."""
    if seconds <= 0:
        return
    deadline = time.perf_counter() + seconds
    if mode == "sleep" and seconds > 3e-4:
        time.sleep(seconds - 3e-4)
    while time.perf_counter() < deadline:
        pass


class _InputPath(torch.autograd.Function):
    """Identity; forward costs `f`, backward (the input gradient) costs `b`."""

    @staticmethod
    def forward(ctx, x, f, b, mode):
        burn(f, mode)
        ctx.b, ctx.mode = b, mode
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        burn(ctx.b, ctx.mode)
        return g, None, None, None


class _WeightPath(torch.autograd.Function):
    """Broadcasts a scalar weight to `ref`'s shape; backward (the weight gradient) costs `w`."""

    @staticmethod
    def forward(ctx, weight, ref, w, mode):
        ctx.w, ctx.mode = w, mode
        return weight.expand(ref.shape).clone()

    @staticmethod
    def backward(ctx, g):
        burn(ctx.w, ctx.mode)
        return g.sum(), None, None, None


class FixedBlock(nn.Module):
    """x -> InputPath(x) + WeightPath(weight): F, B and W each take a fixed time. The input path
    does not lead to the weight, so a weight-only backward (ZB's W) of a one-block stage runs
    only the weight path, and an input-only backward (ZB's B) only the input path."""

    def __init__(self, f: float, b: float, w: float, mode: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.f, self.b, self.w, self.mode = f, b, w, mode

    def forward(
        self, x: torch.Tensor, keys: torch.Tensor | None = None, cache=None, pack=None
    ) -> torch.Tensor:
        """`cache` and `pack` as `Block` takes them from `run_stage` (never given here)."""
        y = _InputPath.apply(x, self.f, self.b, self.mode)
        return y + _WeightPath.apply(self.weight, x.detach(), self.w, self.mode)


class FixedEmbed(nn.Module):
    """Tokens (b, s) -> activations (b, s, h) at no cost. Its scalar weight stands for the
    embedding matrix: stage 0's backward reaches a weight through the block's input path, as
    in the real model (where stage 0's gradient work lands in W under plait's ZB-H1)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.scale = nn.Parameter(torch.ones(()))

    def forward(
        self, tokens: torch.Tensor, keys: torch.Tensor | None = None, pack=None
    ) -> torch.Tensor:
        x = tokens.unsqueeze(-1).expand(*tokens.shape, self.d_model).float() * 1e-3
        return x * self.scale


class MeanLoss(nn.Module):
    """The stand-in's loss; `denom` (plait's loss rule) only scales it, which costs no time."""

    def forward(
        self, out: torch.Tensor, targets: torch.Tensor, denom: float | None = None
    ) -> torch.Tensor:
        return out.float().mean()


class FixedModel(nn.Module):
    """The attributes plait's `run_stage`/`prune_to_stages` use: embed, blocks, norm, head,
    loss and output(x, targets)."""

    def __init__(self, n_layers: int, d_model: int, block_cost: float, mode: str) -> None:
        super().__init__()
        self.embed = FixedEmbed(d_model)
        self.blocks = nn.ModuleList(
            FixedBlock(block_cost, block_cost, block_cost, mode) for _ in range(n_layers)
        )
        self.norm = nn.Identity()
        self.head = nn.Identity()
        self.loss = MeanLoss()

    def output(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, denom: float | None = None
    ) -> torch.Tensor:
        out = self.head(self.norm(x))
        return out if targets is None else self.loss(out, targets, denom)
