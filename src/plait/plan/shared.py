"""A pipeline schedule on ranks that share compute units: processor-sharing simulation (pure).

On a CPU with fewer cores than ranks (`Hardware.contention` c > 1) a rank's speed depends on
how many ranks are computing at that moment: the operating system shares the cores among
the runnable processes, and a rank waiting for a message gives its core away. The
pipeline simulator (`schedule/simulate.py`) times each rank as if it owned
its device; this one lets the ranks' work progress at the shared rate

    rate = min(1, pool / runnable)      pool = p / c  (the cores, counted in pipeline ranks)

where `runnable` counts the pipeline ranks in a compute action, costs are in seconds at the
unshared rate, and each message arrives `comm` after its send. A pipeline rank stands for its
dp x tp replicas, which run the same actions at the same moments, so counting pipeline ranks
against p / c is counting processes against cores.

Between the two bounds the planner used before (the ranks' mean work on the pool; the
critical path at the unshared rate) this is what happens in between: a fill or drain with one
runnable rank leaves cores idle, which neither bound sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.schedule.actions import Kind, Schedule
from plait.schedule.simulate import Costs
from plait.schedule.validate import Slot, match_messages

_EPS = 1e-12


@dataclass
class _State:
    """Where each rank is: its next action, the work left in it, the messages posted."""

    pos: list[int]
    left: list[float | None]  # remaining unshared seconds of the current compute action
    arrive: dict[Slot, float] = field(default_factory=dict)  # send slot -> arrival time
    now: float = 0.0


def shared_makespan(schedule: Schedule, costs: Costs, pool: float) -> float:
    """Seconds until every rank has run its actions, `pool` pipeline ranks' worth of compute
    running at once at most (module doc); `pool >= p` is the unshared simulation."""
    if pool <= 0:
        raise ValueError(f"pool must be > 0, got {pool}")
    matches = match_messages(schedule)
    st = _State([0] * schedule.p, [None] * schedule.p)
    while True:
        moved = True
        while moved:  # a send posted now may free a receive on a rank already passed
            before = list(st.pos)
            for r in range(schedule.p):
                _advance(schedule, costs, matches, st, r)
            moved = st.pos != before
        running = [r for r in range(schedule.p) if st.left[r] is not None]
        waiting = [t - st.now for t in _arrivals(schedule, matches, st) if t > st.now]
        if not running and not waiting:
            if any(pos < len(acts) for pos, acts in zip(st.pos, schedule.ranks, strict=True)):
                raise ValueError(f"{schedule.name}: a receive waits for a send never posted")
            return st.now
        rate = min(1.0, pool / len(running)) if running else 0.0
        dt = min([st.left[r] / rate for r in running] + waiting)  # type: ignore[operator]
        st.now += dt
        for r in running:
            st.left[r] -= rate * dt  # type: ignore[operator]
            if st.left[r] <= _EPS:  # type: ignore[operator]
                st.left[r], st.pos[r] = None, st.pos[r] + 1


def _advance(
    s: Schedule, costs: Costs, matches: dict[Slot, Slot], st: _State, r: int
) -> None:  # fmt: skip
    """Run rank r's free actions (sends, arrived receives, STEP) up to its next compute
    action (whose work it then starts) or a receive still in flight."""
    acts = s.ranks[r]
    while st.pos[r] < len(acts) and st.left[r] is None:
        a = acts[st.pos[r]]
        if a.is_send:
            st.arrive[(r, st.pos[r])] = st.now + float(costs.comm)
        elif a.is_recv:
            arrival = st.arrive.get(matches[(r, st.pos[r])])
            if arrival is None or arrival > st.now + _EPS:
                return
        elif a.kind is not Kind.STEP:
            work = float(costs.duration(a, s.stage(r, a.chunk), s.split_backward))
            if work > _EPS:
                st.left[r] = work
                return
        st.pos[r] += 1


def _arrivals(s: Schedule, matches: dict[Slot, Slot], st: _State) -> list[float]:
    """When the message each blocked rank waits for arrives (posted sends only)."""
    out = []
    for r, acts in enumerate(s.ranks):
        if st.pos[r] < len(acts) and acts[st.pos[r]].is_recv:
            arrival = st.arrive.get(matches[(r, st.pos[r])])
            if arrival is not None:
                out.append(arrival)
    return out
