"""PipeDream-2BW for real: micro-batches of consecutive steps stream through the pipe, no flush.

The whole run is one `two_bw(p, m, steps=S)` schedule, walked by the same `Walker` as every
synchronous schedule (`walker.py`; the validator proves it deadlock-free walked that way). What
2BW adds on top is this file's feed of the walk and where the walk stops. Step k's
micro-batches run F and B on weight version max(k-1, 0) (`weight_versions.py`: version j lives
in copy j % 2 of the rank's stages), drawn when the stream first reaches them, so micro-batches
of consecutive steps are in flight together. Step k's STEP action seals its gradients; the update

    W(k+1) = W(k) - lr_k · AdamW(clip(∇f(W(k-1); batch k)))

runs at a consistent cut before the first forward of step k+2 (`schedule/two_bw_points.py`,
which says why not at STEP: the update needs collectives): the walk yields between batches, and
the stream pauses there. That is the one-step-delayed rule of
PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", 2021):
a rank holds at most two weight versions, and the pipe fills and drains once per run.

Data parallelism composes (each replica runs the same schedule; gradients are averaged over
dp at the update point), and so does tensor parallelism, with or without sequence parallelism:
the tp ranks of a stage run the same action list, so their collectives inside F and B line up
as in the synchronous runtime, and the update applies the split-model gradient rules like any
other step. Virtual stages do not compose (`composition.check_two_bw`).

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

from collections import deque
from collections.abc import Iterator

from torch import Tensor, nn

from plait.microbatch import MicroBatch, MicroBatches
from plait.parallel.pipeline.driver import PipelineDriver
from plait.parallel.pipeline.walker import Flight, Walker
from plait.parallel.pipeline.weight_versions import WeightVersions, weights_of
from plait.schedule.actions import Action, TimedAction
from plait.schedule.schedules import two_bw
from plait.schedule.two_bw_points import update_points

Update = tuple[int, list[Tensor], Tensor, set[int]]
"""A step at its update point: (run's step, its sealed gradients, its summed micro-batch loss,
the weight versions micro-batches in flight still use)."""


class TwoBWStream:
    """One rank's share of an asynchronous 2BW pipeline run (dp x pp x tp ranks), stepped
    one update at a time: a runner of `plait.step` and the feed of its walk."""

    def __init__(
        self,
        pipeline: PipelineDriver,
        versions: WeightVersions,
        batches: MicroBatches,
        steps: int,
        trace_steps: int = 4,
    ) -> None:
        """`steps`: the whole run is one schedule of that many steps. `trace_steps`: keep the
        action timings of about the last this many steps (keeping all would grow with it)."""
        self.pipeline, self.versions, self.batches = pipeline, versions, batches
        self.comm = pipeline.comm
        self.p, self.rank, self.m = pipeline.p, pipeline.rank, pipeline.m
        self.steps, self.trace_steps = steps, trace_steps
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
        pipe, keep = self.pipeline, self.trace_steps * per_step
        self.walker = Walker(
            self.schedule, self.rank, pipe.plans, self.comm, self.versions, self,
            pipe.activation_shape, pipe.activation_dtype, keep,
        )  # fmt: skip
        self._drawn: dict[int, list[MicroBatch]] = {}  # step -> its micro-batches
        self._sealed: dict[int, tuple[list[Tensor], Tensor]] = {}  # step -> (grads, loss sum)
        self._updates = self._walk()

    @property
    def timings(self) -> deque[TimedAction]:
        """The action timings of about the last `trace_steps` steps."""
        return self.walker.timings

    def run(self, step: int) -> Tensor:
        """Walk the stream to step `step`'s update point; hand its gradients to the versions;
        returns this replica's share of the step's token-weighted loss on every pp rank
        (collective over pp)."""
        k, grads, loss_sum, busy = next(self._updates)
        if k != step:
            raise RuntimeError(f"2BW stream is at step {k}, asked for step {step}")
        self.versions.take(k, grads, busy)
        loss = loss_sum  # the micro-batches' sum / the global count; last stage only
        self.comm.all_reduce(loss, "pp", op="sum", tag="loss")
        return loss

    def _walk(self) -> Iterator[Update]:
        """The walk, pausing at every update point (a consistent cut:
        `schedule/two_bw_points.py`); the last two steps are updated at the end."""
        points = update_points(self.schedule)[self.rank]
        flight = Flight()
        for index in self.walker.walk(flight):
            self._measure(flight)  # after the action before `index`
            for k in points.get(index, []):
                yield self._update(k, flight)
        self._measure(flight)
        self.draining = True
        for k in sorted(self._sealed):  # the last two steps: nothing waits for their versions
            yield self._update(k, flight)

    def _update(self, k: int, flight: Flight) -> Update:
        """Schedule step `k`'s gradients, as the run's step `first + k`."""
        self.walker.exchange.drain()  # a consistent cut: every posted send has its receive
        grads, loss_sum = self._sealed.pop(k)
        return self.first_step + k, grads, loss_sum, set(flight.versions.values())

    def _measure(self, flight: Flight) -> None:
        held = set(flight.versions.values()) | {self.versions.latest}
        self.max_versions_held = max(self.max_versions_held, len(held))

    # -- the feed of the walk ------------------------------------------------------------
    def micro_batch_for(self, a: Action) -> MicroBatch:
        """Schedule step `a.step`'s micro-batches for this replica (the run's step first +
        a.step: its data and dropout keys), drawn when first needed (in order)."""
        if a.step not in self._drawn:
            self._drawn[a.step] = self.batches.draw(self.first_step + a.step)
        return self._drawn[a.step][a.microbatch]

    def model_for(self, a: Action) -> tuple[nn.Module, int]:
        """The copy holding the version step `a.step` runs on; its autograd graph and
        gradients stay on that copy."""
        assert a.version == weights_of(a.step), f"schedule: version {a.version}, step {a.step}"
        version = weights_of(self.first_step + a.step)
        return self.versions.model(version), version

    def seal(self, a: Action, flight: Flight) -> None:
        """STEP: take step `a.step`'s gradients off its copy; they wait for its update point."""
        loss = flight.take_loss(a.step, self.comm.mesh.device)
        self._sealed[a.step] = (self.versions.seal(self.first_step + a.step), loss)
        self._drawn.pop(a.step, None)
