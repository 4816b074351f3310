"""One training step, the same for every layout.

    draw the global batch, run the micro-batches     (a runner: accumulation, a pipeline
                                                      schedule, or the 2BW stream)
    finish the data-parallel reduction                engine.finish()
    apply the split-model gradient rules              rules.sync(...)  (parallel/grads.py)
    clip by the global norm                           engine.grad_norm(rules), engine.clip(...)
    a non-finite loss or norm: stop, or skip          check_finite (--nan-policy)
    step                                              engine.step(lr), engine.zero_grad()

What differs between plain data parallelism, ZeRO 1-3 with mixed precision and offload, and
PipeDream-2BW is only the optimizer engine (`parallel/optimizer_engine.py`) and the runner;
`build/rank.py` chooses them, this file runs them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.config import OptimConfig, TrainConfig
from plait.data.batches import StepBatches
from plait.device import synchronize
from plait.errors import NonFiniteError
from plait.microbatch import MicroBatch
from plait.models.loss import target_count
from plait.optim import lr_at
from plait.parallel.grads import SplitGradRules, clip_coef
from plait.parallel.optimizer_engine import OptimizerEngine
from plait.parallel.pipeline.driver import PipelineDriver


@dataclass
class StepResult:
    """What one optimizer step produced (the same on every rank)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    time_s: float
    tokens: int
    drain: bool = False  # 2BW's last updates, after the pipe emptied: not a step's time
    skipped: bool = False  # the optimizer step was skipped (fp16 overflow, --nan-policy skip)


class Runner(Protocol):
    """Runs step k's micro-batches (forward and backward) into the engine's gradients."""

    draining: bool  # the step's time is the pipe's drain, not a step's work (2BW's last)

    def run(self, step: int) -> Tensor:
        """This replica's share of the step's token-weighted loss (its micro-batches' summed
        target losses / `MicroBatch.denom`), the same on every pp and tp rank: the dp
        average of the shares is the global loss."""


class Accumulate:
    """No pipeline: the micro-batches one after the other, gradients accumulated."""

    draining = False

    def __init__(self, model: nn.Module, engine: OptimizerEngine, batches: StepBatches) -> None:
        self.model, self.engine, self.batches = model, engine, batches

    def run(self, step: int) -> Tensor:
        micro = self.batches.draw(step)
        n = len(micro)
        loss_sum = torch.zeros((), device=self.batches.device)
        for i, mb in enumerate(micro):
            self.engine.micro_batch(is_last=i == n - 1)  # communicate after the last only
            # The summed target loss / the global count (over dp): no per-micro-batch mean.
            loss = self.model(mb.tokens, mb.targets, mb.keys, segments=mb.segments, denom=mb.denom)
            self.engine.scale_loss(loss).backward()
            loss_sum += loss.detach().float()
        return loss_sum


class Pipelined:
    """A synchronous pipeline schedule over the step's micro-batches."""

    draining = False

    def __init__(self, pipeline: PipelineDriver, batches: StepBatches) -> None:
        self.pipeline, self.batches = pipeline, batches

    def run(self, step: int) -> Tensor:
        return self.pipeline.run(self.batches.draw(step))


class Step:
    """The loop body: one optimizer step over one global batch, returning the global loss."""

    def __init__(
        self,
        engine: OptimizerEngine,
        runner: Runner,
        rules: SplitGradRules,
        comm: Comm,
        train: TrainConfig,
        optim: OptimConfig,
    ) -> None:
        self.engine, self.runner, self.grad_rules, self.comm = engine, runner, rules, comm
        self.train, self.optim = train, optim

    def __call__(self, step: int) -> StepResult:
        start = time.perf_counter()
        self.comm.stats.begin_step(step)
        engine, lr = self.engine, lr_at(step, self.optim, self.train.steps)
        engine.begin_step()
        loss = self.runner.run(step)
        engine.finish()
        self.grad_rules.sync(engine.grad_pieces(), self.comm)
        norm = engine.grad_norm(self.grad_rules)
        # The replicas' shares average to the global token-weighted loss (denom is N / dp).
        replicas = self.comm.mesh.replicas_axis  # dp, or dp x cp (context_batches.py)
        self.comm.all_reduce(loss, replicas, op="avg", tag="loss")  # global, as the norm is
        loss_value, norm_value = float(loss), float(norm)  # the step's one read of each
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        if finite or engine.scaler is not None:  # fp16: the scaler skips an overflow itself
            engine.clip(clip_coef(norm, self.optim.grad_clip))
            skipped = not engine.step(lr)
            if not (finite or skipped):  # fp16 stepped on a non-finite loss: never keep it
                self.refuse(step, loss_value, norm_value)
        elif self.train.nan_policy == "skip":
            skipped = True
        else:
            self.refuse(step, loss_value, norm_value)
        engine.zero_grad()
        synchronize(self.comm.mesh.device)
        tokens = self.train.global_batch * self.train.seq_len
        elapsed = time.perf_counter() - start
        drain = self.runner.draining
        return StepResult(step, loss_value, lr, norm_value, elapsed, tokens, drain, skipped)

    def refuse(self, step: int, loss: float, norm: float) -> None:
        """--nan-policy stop: every rank raises here at the same step (the loss and the norm
        are global), before an update could reach a checkpoint."""
        raise NonFiniteError(
            f"step {step}: non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} "
            f"on rank {self.comm.mesh.rank} (loss {loss}, gradient norm {norm}); the run "
            "stopped (--nan-policy stop) and its last checkpoint is kept: lower --lr, or "
            "--nan-policy skip to skip such steps"
        )


def evaluate_loss(
    model: nn.Module,
    batches: list[MicroBatch],
    comm: Comm,
    pipeline: PipelineDriver | None,
) -> float:
    """The token-weighted validation loss: every replica's summed target losses over its
    micro-batches, summed over dp, divided by their target tokens (0.0 with none)."""
    loss_sum, targets = evaluate_totals(model, batches, comm, pipeline)
    return loss_sum / max(targets, 1)


@torch.no_grad()
def evaluate_totals(
    model: nn.Module,
    batches: list[MicroBatch],
    comm: Comm,
    pipeline: PipelineDriver | None,
) -> tuple[float, int]:
    """(summed target loss, target tokens) over every replica's `batches`: the two numbers
    validation and `plait eval` divide, exchanged over dp once."""
    was_training = model.training
    model.eval()
    try:
        if pipeline is not None:
            totals = pipeline.evaluate(model, batches)
        else:
            totals = torch.zeros(2, dtype=torch.float64, device=comm.mesh.device)  # sum, tokens
            for mb in batches:  # denom 1.0: the sum of the target losses
                totals[0] += model(mb.tokens, mb.targets, segments=mb.segments, denom=1.0).double()
                totals[1] += target_count(mb.targets)
    finally:
        model.train(was_training)
    comm.all_reduce(totals, comm.mesh.replicas_axis, op="sum", tag="eval")
    return float(totals[0]), int(totals[1])
