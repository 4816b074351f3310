"""Execute one rank's pipeline schedule: compute actions on its stages, p2p for the rest.

The runtime walks the rank's action list front to back in the batches `comm_batches` gives:
a compute action alone, or a run of consecutive sends/receives posted together (one
batch_isend_irecv) whose receives are waited for right before the compute that reads them and
whose sends drain while the rank computes on (`p2p.Exchange`; all are waited for at the end
of the step). The validator proves
every schedule deadlock-free under this execution model, so the runtime needs no logic of its
own about ordering.

Gradient accumulation is exact: each micro-batch's loss (a mean over its tokens) is divided
by m before backward, so the accumulated gradient is that of the step's mean loss. Data
parallelism overlaps as without a pipeline: a chunk's parameters are marked final on the
action that produces their last micro-batch's gradients (B, or W where the backward is split).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.data.batches import MicroBatch
from plait.parallel.optimizer_engine import OptimizerEngine
from plait.parallel.pipeline.p2p import Exchange
from plait.parallel.pipeline.split_backward import WeightWork, split_input_backward
from plait.parallel.pipeline.stage import run_stage
from plait.schedule.actions import Action, Kind, Schedule, TimedAction, comm_batches
from plait.schedule.stages import StagePlan


@dataclass
class _StepState:
    """Tensors in flight during one step, keyed by (micro-batch, chunk)."""

    inputs: dict = field(default_factory=dict)  # stage inputs (activations needing grad)
    outputs: dict = field(default_factory=dict)  # stage outputs (activations or scaled loss)
    grads_in: dict = field(default_factory=dict)  # gradient w.r.t. input, to send back
    grads_out: dict = field(default_factory=dict)  # received gradient w.r.t. output
    pending_w: dict = field(default_factory=dict)  # (output, grad) awaiting W
    loss_sum: Tensor | None = None


class PipelineRuntime:
    """Runs `schedule` for pipeline rank `rank` over the stages in `plans` (one per chunk)."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        model: nn.Module,
        plans: list[StagePlan],
        comm: Comm,
        engine: OptimizerEngine,
        activation_shape: tuple[int, ...],
        activation_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.schedule = schedule
        self.rank = rank
        self.model = model
        self.plans = plans
        self.comm = comm
        self.engine = engine
        self.activation_shape = activation_shape
        self.exchange = Exchange(comm, activation_shape, activation_dtype, comm.mesh.device)
        self.actions = schedule.ranks[rank]
        self.batches = comm_batches(self.actions)
        self.chunk_params = [self._params_of(plan) for plan in plans]
        self._recomputed = [
            any(getattr(self.model.blocks[i], "recomputed", False) for i in plan.layers)
            for plan in plans
        ]
        grad_kind = Kind.W if schedule.split_backward else Kind.B
        self._final = {
            (a.microbatch, a.chunk)
            for a in self.actions
            if a.kind is grad_kind and a.microbatch == schedule.m - 1
        }
        self.timings: list[TimedAction] = []

    def _params_of(self, plan: StagePlan) -> list[nn.Parameter]:
        parts: list[nn.Module] = [self.model.blocks[i] for i in plan.layers]
        if plan.first:
            parts.append(self.model.embed)
        if plan.last:
            parts += [self.model.norm, self.model.head]
        seen: dict[int, nn.Parameter] = {}
        for part in parts:
            for p in part.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    # -- one step --------------------------------------------------------------------------
    def run(self, micro: list[MicroBatch]) -> Tensor:
        """Run the schedule over the step's micro-batches; returns the summed micro-batch loss
        on the last stage (zero elsewhere). Action timings (wall-clock seconds, comparable
        across processes) land in `self.timings`."""
        st = _StepState(loss_sum=torch.zeros((), device=micro[0].tokens.device))
        self.timings = []
        self.engine.micro_batch(is_last=False)
        for batch in self.batches:
            acts = [self.actions[i] for i in batch]
            a = acts[0]
            if not a.is_comm:  # the received input it reads, if any (not timed)
                self.exchange.wait_for(a, (a.microbatch, a.chunk))
            start = time.time()
            if a.is_comm:
                self.exchange.post(acts, [(x.microbatch, x.chunk) for x in acts], st)
            elif a.kind is not Kind.STEP:
                self._compute(a, micro, st)
            end = time.time()
            for i, a in zip(batch, acts, strict=True):
                self.timings.append(TimedAction(self.rank, i, a, start, end))
        self.exchange.drain()
        return st.loss_sum

    # -- compute ---------------------------------------------------------------------------
    def _compute(self, a: Action, micro: list[MicroBatch], st: _StepState) -> None:
        key = (a.microbatch, a.chunk)
        if a.kind is Kind.F:
            self._forward(a, micro[a.microbatch], st)
            return
        final = key in self._final
        if final:
            self.engine.micro_batch(is_last=True)  # this action completes the chunk's gradients
        if a.kind is Kind.B:
            self._backward_input(a, st)
        else:
            self._backward_weight(a, st.pending_w.pop(key))
        if final:
            self.engine.micro_batch(is_last=False)

    def _forward(self, a: Action, mb: MicroBatch, st: _StepState) -> None:
        plan, key = self.plans[a.chunk], (a.microbatch, a.chunk)
        inp = mb.tokens if plan.first else st.inputs[key].requires_grad_()
        st.inputs[key] = inp
        out = run_stage(self.model, plan, inp, mb.keys, mb.targets if plan.last else None)
        if plan.last:
            st.loss_sum += out.detach()
            out = out / self.schedule.m  # the step's loss is the mean over micro-batches
            out = self.engine.scale_loss(out)  # fp16: backward runs on the scaled loss
        st.outputs[key] = out

    def _backward_input(self, a: Action, st: _StepState) -> None:
        plan, key = self.plans[a.chunk], (a.microbatch, a.chunk)
        out, inp = st.outputs.pop(key), st.inputs.pop(key)
        grad = None if plan.last else st.grads_out.pop(key)
        if not self.schedule.split_backward:
            torch.autograd.backward(out, grad)
            if not plan.first:
                st.grads_in[key] = inp.grad
            return
        # Zero-bubble split: the input gradient now (the previous stage waits for it), the
        # weight gradients in W (split_backward.py says how, and when it falls back).
        if plan.first or self._recomputed[a.chunk]:
            if not plan.first:
                (st.grads_in[key],) = torch.autograd.grad(out, inp, grad, retain_graph=True)
            st.pending_w[key] = (out, grad)
            return
        params = self.chunk_params[a.chunk]
        st.grads_in[key], st.pending_w[key] = split_input_backward(out, grad, inp, params)

    def _backward_weight(self, a: Action, pending: WeightWork | tuple) -> None:
        if isinstance(pending, WeightWork):
            pending.run()
        else:  # the plain split: a second backward from the output, parameters only
            out, grad = pending
            torch.autograd.backward(out, grad, inputs=self.chunk_params[a.chunk])
