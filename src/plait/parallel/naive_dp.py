"""Naive data parallelism (`--dp-mode naive`): one coordinator, as the first slide draws it.

This is how `torch.nn.DataParallel` runs on the GPUs of one machine, written over processes:
rank 0 holds the only optimizer. For every micro-batch it scatters the inputs, gathers every
replica's logits, computes the loss over the whole micro-batch and scatters the logits'
gradients back; each replica runs its backward; then the parameter gradients are reduced to
rank 0, which clips and steps alone and broadcasts the new parameters.

It is exact like every other layout (the loss is the summed target loss over the same tokens
divided by the global batch's target count, `MicroBatch.denom` of `draw_whole`; the gradient
the sum of the replicas' parts), and it is slow for the reasons the lesson names, which the
comm layer and the memory tracker measure: the logits (b·s·V per replica) cross the wire
twice per micro-batch, nothing overlaps with compute, the parameters go out again every step,
and rank 0 alone holds the optimizer states and the gathered logits (memory imbalance).
Rank 0 steps plait's one AdamW over the whole trainable parameters (`whole_adamw.py`); frozen
parameters are never reduced, stepped or broadcast (every replica initialized them alike).
`--dp-mode ddp` (the default) is plait's bucketed, overlapped data parallelism.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.config import OptimConfig
from plait.memory_tracker import MemoryTracker, tensor_bytes
from plait.microbatch import MicroBatch, MicroBatches
from plait.models.transformer import Transformer
from plait.parallel.adamw import AdamW
from plait.parallel.grads import SplitGradRules
from plait.parallel.whole_adamw import WholeAdamW, trainable


class Coordinator:
    """The optimizer engine of naive data parallelism: rank 0 owns the optimizer."""

    last_step_skipped = False  # fp32 only
    loss_scale = 1.0
    scaler = None
    saved_states = ("master", "exp_avg", "exp_avg_sq")
    replicated = True  # rank 0 alone writes checkpoints (it alone has the moments)

    def __init__(self, model: Transformer, optim: OptimConfig, comm: Comm) -> None:
        self.model, self.comm = model, comm
        self.lead = comm.mesh.axis_rank("dp") == 0
        named = trainable(list(model.named_parameters()))
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.memory = MemoryTracker(comm.mesh.device)
        self.memory.track("params", "parameters", sum(tensor_bytes(p) for p in self.params))
        frozen = [p for p in model.parameters() if not p.requires_grad]  # a LoRA run's base
        self.memory.track("frozen", "parameters", sum(tensor_bytes(p) for p in frozen))
        self.memory.track("grads", "gradients", sum(tensor_bytes(p) for p in self.params))
        adamw = AdamW.from_optim(optim)  # its moments count as rank 0's optimizer_states
        self.optimizer = (
            WholeAdamW(self.names, self.params, adamw, self.memory) if self.lead else None
        )
        self.step_count = 0
        self._coef = 1.0

    @property
    def current_model(self) -> Transformer:
        return self.model  # every replica holds the whole, current model

    def unsharded(self) -> AbstractContextManager:
        return nullcontext()

    def begin_step(self) -> None:
        self.memory.begin_step()

    def _split(self, flat: Tensor) -> list[Tensor]:
        """A flat buffer of every parameter, as views shaped like them."""
        parts = flat.split([p.numel() for p in self.params])
        return [part.view_as(p) for part, p in zip(parts, self.params, strict=True)]

    def micro_batch(self, is_last: bool) -> None:
        pass  # nothing overlaps: gradients are reduced once, after the last micro-batch

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss

    def finish(self) -> None:
        """Every replica's parameter gradients summed into rank 0's."""
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.reduce(flat, "dp", tag="grad")
        if self.lead:
            for p, part in zip(self.params, self._split(flat), strict=True):
                p.grad = part.clone()

    def grad_pieces(self) -> list[tuple[nn.Parameter, Tensor]]:
        return [(p, p.grad) for p in self.params if p.grad is not None]

    def grad_norm(self, rules: SplitGradRules) -> Tensor:
        """Rank 0 measures it; every rank reports it."""
        zero = torch.zeros((), dtype=torch.float64, device=self.comm.mesh.device)
        norm = rules.norm(self.grad_pieces(), self.comm) if self.lead else zero
        self.comm.broadcast(norm, "dp", tag="grad_norm")
        return norm

    def clip(self, coef: float) -> None:
        self._coef = float(coef)

    def step(self, lr: float) -> bool:
        """Rank 0 alone updates, then broadcasts the parameters: every replica holds the
        same weights between steps (validation, checkpoints)."""
        self.step_count += 1
        if self.lead:
            with torch.no_grad():
                for p in self.params:
                    p.grad.mul_(self._coef)
            grads = [p.grad for p in self.params]
            self.optimizer.step(self.params, grads, self.step_count, lr)
        self._broadcast_parameters()
        return True

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.comm.broadcast(flat, "dp", tag="params")
        for p, part in zip(self.params, self._split(flat), strict=True):
            p.copy_(part)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    # -- checkpoints ---------------------------------------------------------------------
    def named_parameters(self) -> dict[str, nn.Parameter]:
        return dict(zip(self.names, self.params, strict=True))

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's parameters and moments (the only rank that writes: `replicated`)."""
        pieces = self.optimizer.pieces(self.params)
        return {"step": self.step_count, "loss_scaler": None, "pieces": pieces}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every rank loads the parameters; rank 0 also the moments."""
        saved = state["params"]
        if self.lead:
            self.optimizer.load(self.params, saved)
        else:
            for name, p in zip(self.names, self.params, strict=True):
                p.copy_(saved[name]["master"])
        self.step_count = state["step"]

    def close(self) -> None:
        pass


class ScatterGather:
    """The runner: rank 0 hands out each micro-batch, computes the loss, hands back the
    logits' gradients; every replica runs its forward and backward."""

    draining = False

    def __init__(
        self, model: Transformer, engine: Coordinator, batches: MicroBatches, comm: Comm
    ) -> None:
        self.model, self.engine, self.batches, self.comm = model, engine, batches, comm

    def run(self, step: int) -> Tensor:
        micro = self.batches.draw_whole(step)  # every rank draws: the sampler moves alike
        loss_sum = torch.zeros((), device=self.comm.mesh.device)
        for mb in micro:
            loss_sum += self._micro(mb)
        self.comm.broadcast(loss_sum, "dp", tag="loss")
        return loss_sum  # the step's loss: summed target losses / the global count

    def _micro(self, mb: MicroBatch) -> Tensor:
        """One micro-batch of the whole global batch; rank 0's loss (0 elsewhere)."""
        tokens, targets, keys, segments = mb.tokens, mb.targets, mb.keys, mb.segments
        lead, dp = self.engine.lead, self.comm.mesh.size("dp")
        mine = tokens.new_empty((len(tokens) // dp, tokens.shape[1]))
        my_keys = keys.new_empty(len(keys) // dp)
        self.comm.scatter(mine, tokens if lead else None, "dp")
        self.comm.scatter(my_keys, keys if lead else None, "dp")
        my_segments = None
        if segments is not None:  # packed rows: every rank drew them, each keeps its rows
            my_segments = segments.tensor_split(dp)[self.comm.mesh.axis_rank("dp")]
        logits = self.model(mine, None, my_keys, segments=my_segments)
        whole = logits.new_empty((len(tokens), *logits.shape[1:])) if lead else None
        self.comm.gather(whole, logits.detach(), "dp")
        grad, loss = torch.empty_like(logits), torch.zeros((), device=logits.device)
        grad_whole = None
        if lead:
            whole.requires_grad_()
            loss = self._loss(whole, targets, mb)
            loss.backward()
            grad_whole = whole.grad
            gathered = 2 * tensor_bytes(whole)  # the logits and their gradient, on rank 0
            self.engine.memory.track("gathered", "comm_buffers", gathered, transient=True)
        self.comm.scatter(grad, grad_whole, "dp")
        self.engine.memory.release("gathered")
        logits.backward(grad)
        return loss.detach()

    def _loss(self, whole: Tensor, targets: Tensor, mb: MicroBatch) -> Tensor:
        """The whole micro-batch's loss: summed target losses / `denom` (the global count),
        or, where each replica share has its own divisor (loss_average "micro-batch"), the
        sum of the shares' losses, each over its divisor (data/batches.py)."""
        if mb.share_denoms is None:
            return self.model.loss(whole, targets, mb.denom)
        dp = len(mb.share_denoms)
        parts = zip(whole.tensor_split(dp), targets.tensor_split(dp), mb.share_denoms, strict=True)
        return sum(self.model.loss(w, t, d) for w, t, d in parts)
