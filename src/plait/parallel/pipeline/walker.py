"""How a pipeline schedule runs on one rank: one walker for every schedule, 2BW's stream too.

A schedule is data: for every pipeline rank an ordered list of actions, built by
`plait.schedule.schedules`. 1F1B on rank r of p, for instance, is p-r-1 warm-up forwards, then
one forward and one backward in turn, then the cool-down backwards and STEP, with the sends
and receives each of them needs placed around it: `print(one_f_one_b(4, 8))` lists it for
p=4 ranks and m=8 micro-batches, `plait schedule --schedule 1f1b --pp 4 --microbatches 8
--out DIR` draws it. The walker runs one rank's list front to back and decides nothing about
order: the validator (`schedule/validate.py`) proves every schedule deadlock-free walked
exactly this way.

It walks the list in the batches `comm_batches` gives:

- a run of consecutive SEND/RECV actions is posted together (`p2p.Exchange`: one
  batch_isend_irecv through `comm.py`); a received tensor is waited for only right before the
  compute action that reads it, and sends drain while the rank computes on (`p2p.py` says why
  that cannot deadlock);
- F runs the chunk's stage (`stage.run_stage`) on the micro-batch's tokens (first stage) or
  the received activation, with its segments (packed rows) on every stage. On the last stage
  the output is the micro-batch's summed target loss divided by the global batch's count
  (`MicroBatch.denom`, models/loss.py): the gradient accumulated over the step's
  micro-batches is then exactly that of the token-weighted loss (the engine scales it under
  fp16);
- B runs backward from the stage output with the received output gradient and keeps the input
  gradient for SEND_B. Where the schedule splits the backward (ZB-H1), B computes only the
  input gradient and W, later, the weight gradients (`split_backward.py`);
- STEP is whatever the runner makes of it (`Feed.seal`).

Every batch is timed (wall clock, comparable across processes) into `TimedAction`s, which the
trace, the Gantt chart and the measured bubble are drawn from (`plait.schedule.measured`). Data
parallelism overlaps as without a pipeline: a chunk's parameters are marked final
(`engine.micro_batch(is_last=True)`) around the action that produces their last micro-batch's
gradients (B, or W where the backward is split), so each gradient bucket's reduction starts as
soon as it is complete.

What the walk does not know comes from its runner, a `Feed`: the micro-batch an action reads,
the weights it runs on, and what STEP means. `PipelineRuntime` (below) walks a synchronous
schedule once per step over one model; `two_bw.TwoBWStream` walks PipeDream-2BW's run-long
schedule over two weight versions and stops between batches at its update points. The tensors
in flight are one typed record, `Flight`, keyed by (step, micro-batch, chunk). Inside the
trainer, `driver.PipelineDriver` prunes the model to this rank's stages (`stage.py`), builds
the runtime and shares the last stage's loss with every pp rank.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from plait.comm import Comm
from plait.microbatch import MicroBatch
from plait.parallel.optimizer_engine import OptimizerEngine
from plait.parallel.pipeline.p2p import Exchange
from plait.parallel.pipeline.split_backward import (
    PlainWeightWork,
    WeightWork,
    split_input_backward,
)
from plait.parallel.pipeline.stage import run_stage, stage_params, stage_recomputed
from plait.schedule.actions import Action, Kind, Schedule, TimedAction, comm_batches
from plait.schedule.stages import StagePlan

Key = tuple[int, int, int]
"""One micro-batch on one chunk of this rank: (step, micro-batch, chunk). A synchronous
schedule has one step (0); 2BW's stream has micro-batches of two steps in flight at once."""


def key_of(a: Action) -> Key:
    return (a.step, a.microbatch, a.chunk)


@dataclass
class Flight:
    """The tensors in flight on this rank during a walk, keyed by `Key`."""

    inputs: dict[Key, Tensor] = field(default_factory=dict)  # stage inputs (tokens, activations)
    outputs: dict[Key, Tensor] = field(default_factory=dict)  # activations, or the loss
    grads_in: dict[Key, Tensor] = field(default_factory=dict)  # w.r.t. inputs, to send back
    grads_out: dict[Key, Tensor] = field(default_factory=dict)  # received, w.r.t. outputs
    pending_w: dict[Key, WeightWork | PlainWeightWork] = field(default_factory=dict)  # B done
    versions: dict[Key, int] = field(default_factory=dict)  # F done, B not: weights it ran on
    losses: dict[int, Tensor] = field(default_factory=dict)  # step -> summed micro-batch loss

    def add_loss(self, step: int, loss: Tensor) -> None:
        """Add a micro-batch's loss (last stage) to its step's sum, kept in fp32."""
        if step not in self.losses:
            self.losses[step] = torch.zeros((), device=loss.device)
        self.losses[step] += loss

    def take_loss(self, step: int, device: torch.device) -> Tensor:
        """Step `step`'s summed micro-batch loss (zero off the last stage), forgotten here."""
        loss = self.losses.pop(step, None)
        return torch.zeros((), device=device) if loss is None else loss


class Feed(Protocol):
    """What a walk asks its runner: an action's data and weights, and what STEP means."""

    def micro_batch_for(self, a: Action) -> MicroBatch:
        """The micro-batch an F reads (tokens on the first stage, targets on the last)."""
        ...

    def model_for(self, a: Action) -> tuple[nn.Module, int]:
        """The model (this rank's stages) an F or B runs on, and its weight version."""
        ...

    def seal(self, a: Action, flight: Flight) -> None:
        """STEP: every backward of step `a.step` on this rank is done."""
        ...


class ActionHooks(Protocol):
    """Called around each F, B and W (ZeRO-3's gathers under a pipeline:
    `zero/pipeline_gather.py`)."""

    def before(self, kind: Kind, chunk: int) -> None: ...

    def after(self, kind: Kind, chunk: int) -> None: ...


class Walker:
    """Walks pipeline rank `rank`'s actions of `schedule` over its stages `plans` (one per
    chunk); `engine` marks final micro-batches for data parallelism and scales the loss."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        plans: list[StagePlan],
        comm: Comm,
        engine: OptimizerEngine,
        feed: Feed,
        activation_shape: tuple[int, ...],
        activation_dtype: torch.dtype = torch.float32,
        keep: int | None = None,
        actions: ActionHooks | None = None,
    ) -> None:
        """Activations and gradients travel as `activation_shape` in `activation_dtype`;
        `keep`: how many action timings to keep, the newest (None: all); `actions`: told
        before and after every compute action."""
        self.schedule, self.rank, self.plans = schedule, rank, plans
        self.hooks = actions
        self.engine, self.feed = engine, feed
        self.actions = schedule.ranks[rank]
        self.batches = comm_batches(self.actions)
        self.exchange = Exchange(comm, activation_shape, activation_dtype, comm.mesh.device)
        grad_kind = Kind.W if schedule.split_backward else Kind.B
        self._final = {
            key_of(a)
            for a in self.actions
            if a.kind is grad_kind and a.microbatch == schedule.m - 1
        }
        self._stages: dict[tuple[nn.Module, int], tuple[list[nn.Parameter], bool]] = {}
        self.timings: deque[TimedAction] = deque(maxlen=keep)

    def walk(self, flight: Flight) -> Iterator[int]:
        """Run every action, batch by batch, keeping what is in flight in `flight`. Before
        each batch, yield the index of its first action: a runner may act there, between
        batches (2BW updates its weights at such points). Ends with nothing in flight."""
        self.engine.micro_batch(is_last=False)
        for batch in self.batches:
            yield batch.start
            acts = [self.actions[i] for i in batch]
            first = acts[0]
            if not first.is_comm:  # the received input it reads, if any (not timed)
                self.exchange.wait_for(first, key_of(first))
            start = time.time()
            if first.is_comm:
                self.exchange.post(acts, [key_of(a) for a in acts], flight)
            else:
                self._compute(first, flight)
            end = time.time()
            self.timings.extend(
                TimedAction(self.rank, i, a, start, end) for i, a in zip(batch, acts, strict=True)
            )
        self.exchange.drain()

    def run(self, flight: Flight) -> None:
        """Walk every action without stopping."""
        for _ in self.walk(flight):
            pass

    # -- compute ---------------------------------------------------------------------------
    def _compute(self, a: Action, flight: Flight) -> None:
        if a.kind is Kind.STEP:
            self.feed.seal(a, flight)
            return
        if self.hooks:
            self.hooks.before(a.kind, a.chunk)
        if a.kind is Kind.F:
            self._forward(a, flight)
        else:
            self._gradients(a, flight)
        if self.hooks:
            self.hooks.after(a.kind, a.chunk)

    def _gradients(self, a: Action, flight: Flight) -> None:
        """B or W, marked final for data parallelism where it completes the chunk's
        gradients of the step."""
        final = key_of(a) in self._final
        if final:
            self.engine.micro_batch(is_last=True)  # this action completes the chunk's gradients
        if a.kind is Kind.B:
            self._backward_input(a, flight)
        else:  # W: the weight gradients its B left (split backward)
            flight.pending_w.pop(key_of(a)).run()
        if final:
            self.engine.micro_batch(is_last=False)

    def _forward(self, a: Action, flight: Flight) -> None:
        plan, key = self.plans[a.chunk], key_of(a)
        model, version = self.feed.model_for(a)
        mb = self.feed.micro_batch_for(a)
        inp = mb.tokens if plan.first else flight.inputs[key].requires_grad_()
        flight.inputs[key] = inp
        targets = mb.targets if plan.last else None
        out = run_stage(model, plan, inp, mb.keys, targets, mb.segments, mb.denom)
        if plan.last:  # the micro-batch's share of the step's token-weighted loss
            flight.add_loss(a.step, out.detach())
            out = self.engine.scale_loss(out)  # fp16: backward runs on the scaled loss
        flight.outputs[key], flight.versions[key] = out, version

    def _backward_input(self, a: Action, flight: Flight) -> None:
        plan, key = self.plans[a.chunk], key_of(a)
        out, inp = flight.outputs.pop(key), flight.inputs.pop(key)
        grad = None if plan.last else flight.grads_out.pop(key)
        del flight.versions[key]
        if not self.schedule.split_backward:
            torch.autograd.backward(out, grad)  # onto the weights the forward ran with
            if not plan.first:
                flight.grads_in[key] = inp.grad
            return
        # Zero-bubble split: the input gradient now (the previous stage waits for it), the
        # weight gradients in W (split_backward.py says how, and when it falls back).
        params, recomputed = self._stage(a)
        if plan.first or recomputed:
            if not plan.first:
                (flight.grads_in[key],) = torch.autograd.grad(out, inp, grad, retain_graph=True)
            flight.pending_w[key] = PlainWeightWork(out, grad, params)
            return
        flight.grads_in[key], flight.pending_w[key] = split_input_backward(out, grad, inp, params)

    def _stage(self, a: Action) -> tuple[list[nn.Parameter], bool]:
        """The parameters of `a`'s chunk in the weights it runs on, and whether the chunk
        recomputes: looked up once per model and chunk."""
        model, _ = self.feed.model_for(a)
        known = self._stages.get((model, a.chunk))
        if known is None:
            plan = self.plans[a.chunk]
            known = (stage_params(model, plan), stage_recomputed(model, plan))
            self._stages[(model, a.chunk)] = known
        return known


class PipelineRuntime:
    """A synchronous schedule (GPipe, 1F1B, interleaved, ZB-H1): one walk per step over one
    model and the step's micro-batches; the optimizer step follows the walk (`plait.step`)."""

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
        actions: ActionHooks | None = None,
    ) -> None:
        self.schedule, self.model = schedule, model
        self._micro: list[MicroBatch] = []
        self.walker = Walker(
            schedule, rank, plans, comm, engine, self, activation_shape, activation_dtype,
            actions=actions,
        )  # fmt: skip

    @property
    def timings(self) -> deque[TimedAction]:
        """The last step's action timings (wall-clock seconds, comparable across processes)."""
        return self.walker.timings

    def run(self, micro: list[MicroBatch]) -> Tensor:
        """Run the schedule over the step's micro-batches; returns the summed micro-batch loss
        on the last stage (zero elsewhere)."""
        self.walker.timings.clear()
        flight, self._micro = Flight(), micro
        try:
            self.walker.run(flight)
        finally:
            self._micro = []
        return flight.take_loss(0, micro[0].tokens.device)

    # -- the feed of the walk --------------------------------------------------------------
    def micro_batch_for(self, a: Action) -> MicroBatch:
        return self._micro[a.microbatch]

    def model_for(self, a: Action) -> tuple[nn.Module, int]:
        return self.model, 0  # one weight version

    def seal(self, a: Action, flight: Flight) -> None:
        pass  # the step's gradients are complete; the step's update runs after the walk
