"""Collectives by phase of a real training step: each micro-batch's forward, its backward, and
what the step does once after them (gradient sync, norm, optimizer, loss).

`CommStats` totals a step. To separate the phases a `PhaseMeter` snapshots those totals at
the boundaries and keeps the differences; nothing is attributed by assumption:

    forward  starts   model forward pre-hook     (after the runner's engine.micro_batch)
    backward starts   model forward hook         (the loss exists; the runner calls backward)
    step     starts   the runner returns         (every micro-batch's backward is done)
    end               Step returns               (finish, split-gradient sync, norm, loss)

Between the forward hook and the next pre-hook the runner does only the backward and the
next `engine.micro_batch`, which communicates nothing at ZeRO stage 0 (plain data parallel
buckets launch *during* the backward, and are counted there). The hooks are public
`nn.Module` hooks on the unchanged model, removed when the meter detaches; the meter belongs
to one run (no module-level state).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from plait.comm import CommStats
from plait.step import Runner

Key = tuple[str, str, str]
"""(op, axis, tag) of a collective."""
Counts = dict[Key, tuple[int, int, int]]
"""(op, axis, tag) -> (calls, logical elements, logical bytes)."""


def snapshot(stats: CommStats) -> Counts:
    """The step's totals so far, summed over dtypes."""
    out: Counts = {}
    for r in stats.records.values():
        calls, elements, nbytes = out.get((r.op, r.axis, r.tag), (0, 0, 0))
        out[(r.op, r.axis, r.tag)] = (calls + r.calls, elements + r.elements, nbytes + r.bytes)
    return out


def minus(after: Counts, before: Counts) -> Counts:
    """What happened between two snapshots of one step (keys that did not move dropped)."""
    out: Counts = {}
    for key, now in after.items():
        then = before.get(key, (0, 0, 0))
        diff = tuple(a - b for a, b in zip(now, then, strict=True))
        if any(diff):
            out[key] = diff  # type: ignore[assignment]
    return out


def as_rows(counts: Counts) -> list[dict[str, Any]]:
    """JSON-friendly rows: op, axis, tag, calls, elements, bytes."""
    return [
        {"op": op, "axis": axis, "tag": tag, "calls": c, "elements": e, "bytes": b}
        for (op, axis, tag), (c, e, b) in sorted(counts.items())
    ]


class PhaseMeter:
    """Snapshots of a step's CommStats at its phase boundaries (see the module docstring)."""

    def __init__(self, stats: CommStats) -> None:
        self.stats = stats
        self._marks: list[tuple[str, Counts]] = []

    def mark(self, phase: str) -> None:
        """`phase` starts now."""
        self._marks.append((phase, snapshot(self.stats)))

    @contextmanager
    def attached(self, model: nn.Module) -> Iterator[PhaseMeter]:
        """Mark each forward's start and end on `model` while the block runs."""
        handles = [
            model.register_forward_pre_hook(lambda _m, _a: self.mark("forward")),
            model.register_forward_hook(lambda _m, _a, _o: self.mark("backward")),
        ]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def take(self) -> list[dict[str, Any]]:
        """The finished step's phases in order, [{"phase", "counts"}], and a fresh start.
        Call it after the step returns: the last phase ("step") ends here."""
        self.mark("end")
        marks, self._marks = self._marks, []
        phases = []
        if marks and marks[0][1]:  # anything before the first forward (expected: nothing)
            phases.append({"phase": "before", "counts": as_rows(marks[0][1])})
        for (phase, before), (_, after) in itertools.pairwise(marks):
            phases.append({"phase": phase, "counts": as_rows(minus(after, before))})
        return phases


class MarkedRunner:
    """A step runner that marks the start of the step's once-per-step work when its
    micro-batches are done (delegates everything else to the runner it wraps)."""

    def __init__(self, inner: Runner, meter: PhaseMeter) -> None:
        self.inner, self.meter = inner, meter
        self.draining = inner.draining

    def run(self, step: int) -> Tensor:
        loss = self.inner.run(step)
        self.meter.mark("step")
        return loss
