"""PipeDream-2BW for real: micro-batches of consecutive steps stream through the pipe, no flush.

The whole run is one `two_bw(p, m, steps=S)` schedule, walked in `comm_batches` exactly like
the synchronous `PipelineRuntime` (the validator proves it deadlock-free that way). Step k's
micro-batches run F and B on weight version max(k-1, 0) (`async_2bw_versions`: version j lives
in copy j % 2 of the rank's stages). Step k's STEP action seals its gradients; the update

    W(k+1) = W(k) - lr_k · AdamW(clip(∇f(W(k-1); batch k)))

runs at a consistent cut before the first forward of step k+2 (`async_2bw_points`, which says
why not at STEP: the update needs collectives). That is the one-step-delayed rule of
PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", 2021):
a rank holds at most two weight versions, and the pipe fills and drains once per run.

Data parallelism composes (each replica runs the same schedule; gradients are averaged over
dp at the update point), and so does tensor parallelism, with or without sequence parallelism:
the tp ranks of a stage run the same action list, so their collectives inside F and B line up
as in the synchronous runtime, and the update applies the split-model gradient rules like any
other step. Virtual stages do not compose (`rules.check_two_bw`).

The stream is a runner of the one training step (`plait.step`): `run(k)` walks the schedule
up to step k's update point and hands step k's gradients to the `WeightVersions` engine; the
step then averages, clips and updates as for every other layout, at the consistent cut, so
whatever runs between steps (validation, logging) may use collectives too.

A checkpoint at a step boundary k holds W(k) and W(k-1) (`WeightVersions.state_dict`), not
the micro-batches of step k already in flight: a resumed stream (`start_at(k)`) walks the
schedule of the remaining steps, whose step j is the run's step k + j, and runs step k's
micro-batches again on W(k-1), to the same bits.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from plait.data.batches import MicroBatch, StepBatches
from plait.parallel.pipeline.driver import PipelineDriver
from plait.parallel.pipeline.p2p import Exchange
from plait.parallel.pipeline.stage import run_stage
from plait.parallel.pipeline.weight_versions import WeightVersions, weights_of
from plait.schedule.actions import Action, Kind, TimedAction, comm_batches
from plait.schedule.schedules import two_bw
from plait.schedule.two_bw_points import update_points


@dataclass
class _Flight:
    """Tensors in flight, keyed by (step, micro-batch): micro-batches of two steps overlap."""

    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    grads_in: dict = field(default_factory=dict)
    grads_out: dict = field(default_factory=dict)
    version: dict = field(default_factory=dict)  # forward done, backward not: version used
    data: dict = field(default_factory=dict)  # step -> its micro-batches
    loss: dict = field(default_factory=dict)  # step -> summed micro-batch loss (last stage)
    sealed: dict = field(default_factory=dict)  # step -> (gradients, loss sum) awaiting update


class TwoBWStream:
    """One rank's share of an asynchronous 2BW pipeline run (dp x pp x tp ranks), stepped
    one update at a time."""

    def __init__(
        self,
        pipeline: PipelineDriver,
        versions: WeightVersions,
        batches: StepBatches,
        steps: int,
        trace_steps: int = 4,
    ) -> None:
        """`steps`: the whole run is one schedule of that many steps. `trace_steps`: keep the
        action timings of about the last this many steps (keeping all would grow with it)."""
        self.pipeline, self.versions, self.batches = pipeline, versions, batches
        self.comm = pipeline.comm
        self.p, self.rank, self.m = pipeline.p, pipeline.rank, pipeline.m
        (self.plan,) = pipeline.plans
        self.steps, self.trace_steps = steps, trace_steps
        self.exchange = Exchange(
            self.comm, pipeline.activation_shape, torch.float32, self.comm.mesh.device
        )
        self.max_versions_held = 0  # distinct versions needed at once, measured per action
        self.start_at(0)

    def start_at(self, first: int) -> None:
        """Stream steps `first`.. of the run (a resumed run: the versions hold W(first) and
        W(first-1)). The schedule of the remaining steps has the same shape as a fresh one;
        its step j is the run's step first + j, and runs on version max(first + j - 1, 0)."""
        self.first_step, remaining = first, self.steps - first
        self.draining = False  # the last updates, after the schedule ended
        if remaining < 1:
            return
        self.schedule = two_bw(self.p, self.m, 1, remaining)
        per_step = len(self.schedule.ranks[self.rank]) // remaining + 1
        self.timings: deque[TimedAction] = deque(maxlen=self.trace_steps * per_step)
        self._updates = self._walk()

    def run(self, step: int) -> Tensor:
        """Walk the stream to step `step`'s update point; hand its gradients to the versions;
        returns the step's mean loss on every pp rank (collective over pp)."""
        k, grads, loss_sum, busy = next(self._updates)
        if k != step:
            raise RuntimeError(f"2BW stream is at step {k}, asked for step {step}")
        self.versions.take(k, grads, busy)
        loss = loss_sum / self.m  # nonzero on the last stage only
        self.comm.all_reduce(loss, "pp", op="sum", tag="loss")
        return loss

    def _walk(self) -> Iterator[tuple[int, list[Tensor], Tensor, set[int]]]:
        """The schedule, action by action, pausing at every update point (a consistent cut:
        `plan/two_bw_points.py`); the last two steps are updated at the end."""
        actions = self.schedule.ranks[self.rank]
        points = update_points(self.schedule)[self.rank]
        fl = _Flight()
        for batch in comm_batches(actions):
            for k in points.get(batch.start, []):
                yield self._sealed(k, fl)
            acts = [actions[i] for i in batch]
            if not acts[0].is_comm:  # the received input it reads, if any (not timed)
                self.exchange.wait_for(acts[0], (acts[0].step, acts[0].microbatch))
            start = time.time()
            if acts[0].is_comm:
                self.exchange.post(acts, [(a.step, a.microbatch) for a in acts], fl)
            else:
                self._compute(acts[0], fl)
            end = time.time()
            self.timings.extend(
                TimedAction(self.rank, i, a, start, end) for i, a in zip(batch, acts, strict=True)
            )
            held = set(fl.version.values()) | {self.versions.latest}
            self.max_versions_held = max(self.max_versions_held, len(held))
        self.draining = True
        for k in sorted(fl.sealed):  # the last two steps: nothing waits for their versions
            yield self._sealed(k, fl)

    def _sealed(self, k: int, fl: _Flight) -> tuple[int, list[Tensor], Tensor, set[int]]:
        """Schedule step `k`'s gradients, as the run's step `first + k`."""
        self.exchange.drain()  # a consistent cut: every posted send has its receive
        grads, loss_sum = fl.sealed.pop(k)
        return self.first_step + k, grads, loss_sum, set(fl.version.values())

    # -- compute -------------------------------------------------------------------------
    def _compute(self, a: Action, fl: _Flight) -> None:
        if a.kind is Kind.F:
            self._forward(a, fl)
        elif a.kind is Kind.B:
            self._backward(a, fl)
        else:  # STEP: the step's gradients are complete on this rank
            loss = fl.loss.pop(a.step, torch.zeros((), device=self.comm.mesh.device))
            fl.sealed[a.step] = (self.versions.seal(self.first_step + a.step), loss)
            fl.data.pop(a.step, None)

    def _forward(self, a: Action, fl: _Flight) -> None:
        key, version = (a.step, a.microbatch), weights_of(self.first_step + a.step)
        assert a.version == weights_of(a.step), f"schedule: version {a.version}, step {a.step}"
        mb = self._micro(a.step, fl)[a.microbatch]
        inp = mb.tokens if self.plan.first else fl.inputs[key].requires_grad_()
        fl.inputs[key] = inp
        targets = mb.targets if self.plan.last else None
        out = run_stage(self.versions.model(version), self.plan, inp, mb.keys, targets)
        if self.plan.last:
            fl.loss[a.step] = fl.loss.get(a.step, 0.0) + out.detach()
            out = out / self.m  # the step's loss is the mean over its micro-batches
        fl.outputs[key], fl.version[key] = out, version

    def _backward(self, a: Action, fl: _Flight) -> None:
        key = (a.step, a.microbatch)
        out, inp = fl.outputs.pop(key), fl.inputs.pop(key)
        grad = None if self.plan.last else fl.grads_out.pop(key)
        torch.autograd.backward(out, grad)  # onto the parameters of the version it ran with
        if not self.plan.first:
            fl.grads_in[key] = inp.grad
        del fl.version[key]

    def _micro(self, step: int, fl: _Flight) -> list[MicroBatch]:
        """Schedule step `step`'s micro-batches for this replica (the run's step first +
        step: its data and dropout keys), drawn when first needed (in order)."""
        if step not in fl.data:
            fl.data[step] = self.batches.draw(self.first_step + step)
        return fl.data[step]
