"""Event-driven simulation of a schedule under a cost model: timings, bubble, memory.

Cost convention. `Costs(f, b, w)` are the durations of one stage's forward, input-gradient
backward and weight-gradient backward for one micro-batch. A schedule that does not split the
backward runs B as the whole backward, costing b + w; ZB-H1 runs B (cost b) and W (cost w)
separately. One Costs object therefore compares every schedule on equal work; the default
f = b = w = 1 is the classic "backward = 2 × forward". For interleaved schedules the costs are
per chunk (stage), so a chunk of a p-stage model cut into v chunks costs 1/v of a stage; pass
Fractions to keep the arithmetic exact.

Execution model. Each rank runs its actions in order from time 0. A compute action takes its
cost; STEP is free; a SEND is posted instantly (non-blocking) and its tensor arrives `comm`
later; a RECV ends when its tensor has arrived. Bubble fraction = idle compute time over
p × makespan, where a rank is idle whenever it is not computing (waiting in a RECV, or done
before the makespan).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from plait.schedule.actions import Action, Kind, Schedule, TimedAction
from plait.schedule.validate import execution_order, match_messages, validate

Time = float | Fraction
"""Simulated time; any real number type (Fractions give exact results)."""

Cost = Time | Sequence[Time]
"""One value for every stage, or one per global stage (length p·v)."""


@dataclass(frozen=True)
class Costs:
    """Per micro-batch durations of one stage's work (see the module doc for the convention)."""

    f: Cost = 1
    b: Cost = 1
    w: Cost = 1
    comm: Time = 0

    def duration(self, action: Action, stage: int, split_backward: bool) -> Time:
        """How long a compute action on `stage` takes (0 for STEP and communication)."""
        if action.kind is Kind.F:
            return _at(self.f, stage)
        if action.kind is Kind.B:
            return _at(self.b, stage) + (0 if split_backward else _at(self.w, stage))
        if action.kind is Kind.W:
            return _at(self.w, stage)
        return 0

    @property
    def uniform(self) -> bool:
        return all(not isinstance(c, Sequence) for c in (self.f, self.b, self.w))


def _at(cost: Cost, stage: int) -> Time:
    return cost[stage] if isinstance(cost, Sequence) else cost


@dataclass(frozen=True)
class Simulation:
    """What simulate() found. Per-rank tuples are indexed by rank.

    `peak_in_flight`: most (micro-batch, chunk) activations a rank holds at once, counting from
    the end of F to the end of B (with v chunks each is 1/v of a stage's activations; ZB-H1's W
    keeps only the smaller tensors the weight gradient needs). `peak_weight_versions`: most
    weight versions a rank holds at once (1 unless the schedule carries versions).
    """

    schedule: Schedule
    costs: Costs
    timings: tuple[TimedAction, ...]
    makespan: Time
    busy: tuple[Time, ...]
    bubble_fraction: Time
    peak_in_flight: tuple[int, ...]
    peak_weight_versions: tuple[int, ...]


def simulate(schedule: Schedule, costs: Costs | None = None) -> Simulation:
    """Validate, then time every action of the schedule under `costs` (module doc)."""
    costs = costs or Costs()
    validate(schedule)
    matches = match_messages(schedule)
    clock: list[Time] = [0] * schedule.p  # every rank starts at 0
    ends: dict[tuple[int, int], Time] = {}
    timings = []
    for r, i in execution_order(schedule, matches, batched=False):
        a = schedule.ranks[r][i]
        start = clock[r]
        if a.is_recv:
            end = max(start, ends[matches[(r, i)]] + costs.comm)
        else:
            end = start + costs.duration(a, schedule.stage(r, a.chunk), schedule.split_backward)
        clock[r] = ends[(r, i)] = end
        timings.append(TimedAction(r, i, a, start, end))
    timings.sort(key=lambda t: (t.rank, t.index))
    makespan, busy, bubble = measure(timings, schedule.p)
    return Simulation(
        schedule,
        costs,
        tuple(timings),
        makespan,
        busy,
        bubble,
        tuple(_peak_in_flight(acts) for acts in schedule.ranks),
        tuple(_peak_versions(acts) for acts in schedule.ranks),
    )


def measure(timings: Sequence[TimedAction], p: int) -> tuple[Time, tuple[Time, ...], Time]:
    """(makespan, compute time per rank, bubble fraction) of timing records, simulated or
    measured, so a run's measured bubble uses the simulator's definition. The makespan runs
    from the earliest start to the latest end over all ranks."""
    makespan = max(t.end for t in timings) - min(t.start for t in timings)
    busy = tuple(
        sum((t.duration for t in timings if t.rank == r and t.action.is_compute), 0)
        for r in range(p)
    )
    return makespan, busy, _ratio(p * makespan - sum(busy), p * makespan)


def _peak_in_flight(actions: Sequence[Action]) -> int:
    """Most forwards done whose backward is not: the activations a rank must keep."""
    return int(peak_held(actions))


def peak_held(
    actions: Sequence[Action],
    weight: Callable[[int], Time] = lambda chunk: 1,
    until_w: bool = False,
) -> Time:
    """Most activations a rank holds at once, each F adding `weight(chunk)` until its B
    (or, `until_w`, its W: a split backward keeps the graph for the weight gradients).

    With unit weights this is the number of (micro-batch, chunk) pairs in flight; with each
    chunk's activation bytes it is the peak the memory estimator reports (`plait.estimate`).
    """
    done = Kind.W if until_w else Kind.B
    held = peak = 0
    for a in actions:
        if a.kind is Kind.F:
            held += weight(a.chunk)
        elif a.kind is done:
            held -= weight(a.chunk)
        if held > peak:  # not max(): a planner walks millions of actions
            peak = held
    return peak


def in_flight(schedule: Schedule, rank: int, until_w: bool = False) -> frozenset[tuple[int, ...]]:
    """Every count of activations held per chunk that `rank` passes through (each F holds
    one until its B, or `until_w` its W), the empty start included; walked once per
    schedule (`Schedule.derived`)."""
    key = ("in_flight", rank, until_w)
    if key not in schedule.derived:
        done = Kind.W if until_w else Kind.B
        held, seen = [0] * schedule.v, {(0,) * schedule.v}
        for a in schedule.ranks[rank]:
            if a.kind is Kind.F or a.kind is done:
                held[a.chunk] += 1 if a.kind is Kind.F else -1
                seen.add(tuple(held))
        schedule.derived[key] = frozenset(seen)
    return schedule.derived[key]  # type: ignore[return-value]


def peak_by_chunk(
    schedule: Schedule, rank: int, weights: Sequence[int], until_w: bool = False
) -> int:
    """`peak_held` of `rank`'s actions with whole-number weights per chunk (`weights[c]`),
    from the counts walked once (`in_flight`): the same peak, for a planner weighing one
    schedule thousands of times."""
    return max(
        sum(n * w for n, w in zip(counts, weights, strict=True))
        for counts in in_flight(schedule, rank, until_w)
    )


def _peak_versions(actions: Sequence[Action]) -> int:
    """Most weight versions alive at once: a version lives from the STEP that makes it (version 0
    from the start) to its last use or the next version's creation, whichever is later."""
    made = {0: 0}
    last_use: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.version is None:
            continue
        if a.kind is Kind.STEP:
            made[a.version] = i
        else:
            last_use[a.version] = i
    alive = []
    for ver, born in made.items():
        until = max(last_use.get(ver, born), made.get(ver + 1, len(actions)))
        alive.append((born, until))
    return max(sum(born <= i <= until for born, until in alive) for i in range(len(actions) + 1))


def predicted_bubble(schedule: Schedule, costs: Costs | None = None) -> Time | None:
    """The published bubble fraction for this schedule, or None where no formula applies.

    With T = f + b + w (a whole forward and backward of one stage, one micro-batch):
    naive: the pipe fills and drains for every micro-batch, m·(p-1)·T of m·T work: (p-1)/p.
    gpipe, 1f1b: bubble time (p-1)·T of m·T work, fraction (p-1)/(m+p-1).
    interleaved: (p-1)·T with T per chunk, i.e. the p-stage bubble divided by v, of v·m·T work.
    zb-h1: (p-1)·(f + b - w) of m·T work (Qi et al., 2023).
    2bw: no flush, so one fill and one drain, (p-1)·T, for all steps·m micro-batches.
    None for per-stage costs or a nonzero communication cost, where no closed form holds.
    """
    costs = costs or Costs()
    if not costs.uniform or costs.comm:
        return None
    p, m, v = schedule.p, schedule.m, schedule.v
    t = costs.f + costs.b + costs.w
    fills = m if schedule.name == "naive" else 1
    bubble = fills * (p - 1) * (costs.f + costs.b - costs.w if schedule.split_backward else t)
    work = schedule.steps * m * v * t
    return _ratio(bubble, work + bubble)


def _ratio(a: Time, b: Time) -> Time:
    """a / b, exact (a Fraction) when both are rational, so integer costs give exact bubbles."""
    if not b:
        return 0
    if isinstance(a, float) or isinstance(b, float):
        return a / b
    return Fraction(a) / Fraction(b)
