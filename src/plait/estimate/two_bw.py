"""PipeDream-2BW's moments: the stream never flushes, so a step's gradients outlive its last
backward.

2BW (`parallel/pipeline/weight_versions.py`) accumulates step k's gradients on the weight
copy step k runs with, from its first backward on this rank; its STEP seals them and they
wait for the update, which runs at a consistent cut just before step k+2's first forward
(`schedule/two_bw_points.py`). Meanwhile step k+1's backwards accumulate on the other copy:
for a while two gradient sets are alive, beside the micro-batches in flight. So the
gradients are not a fixed model state here: the walk over the rank's action list of the 2BW
schedule counts, after every forward and backward, the activations held and the gradient
sets alive, and each such moment is one `Moment` of the estimate (`estimate/peak.py`).
"""

from __future__ import annotations

from plait.estimate.lines import Moment
from plait.schedule.actions import Action, Kind
from plait.schedule.schedules import two_bw
from plait.schedule.two_bw_points import update_points

STEPS = 4  # enough for the stream's steady state: steps 1 and 2 are full ones

Stream = tuple[tuple[str, int, int], ...]
"""One rank's stream: after each forward and backward, (the action, micro-batches held,
gradient sets alive)."""


def two_bw_streams(p: int, m: int) -> list[Stream]:
    """Every rank's stream, walked once per estimate. Past m = 2p micro-batches per step the
    pattern only repeats (held at most p - r, two sets at once; checked for p <= 6 up to
    m = 4p), so a longer step is walked as 2p: a planner estimates many layouts."""
    schedule = two_bw(p, min(m, 2 * p), 1, STEPS)
    points = update_points(schedule)
    return [_walk(actions, points[r]) for r, actions in enumerate(schedule.ranks)]


def _walk(actions: list[Action], points: dict[int, list[int]]) -> Stream:
    held, sets, out = 0, set(), []
    for i, a in enumerate(actions):
        for k in points.get(i, []):
            sets.discard(k)  # updated: the step's gradients are consumed and freed
        if a.kind is Kind.F:
            held += 1
        elif a.kind is Kind.B:
            held -= 1
            sets.add(a.step)
        else:
            continue
        out.append((str(a), held, len(sets)))
    return tuple(out)


def two_bw_moments(stream: Stream, chunk: int, grad_set: int, receive: int) -> tuple[Moment, ...]:
    """The moments of one rank's stream: `chunk` device bytes one micro-batch saves,
    `grad_set` bytes of one set of its gradients, `receive` its receive buffers."""
    return tuple(
        Moment(
            f"2BW after {name}",
            (
                ("activations", held * chunk),
                ("gradients", sets * grad_set),
                ("receive_buffers", receive),
            ),
        )
        for name, held, sets in stream
    )
