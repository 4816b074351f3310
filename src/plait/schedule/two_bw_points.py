"""Where the 2BW runtime applies each step's weight update: points that are consistent cuts.

Why not at the STEP action itself? Producing version k+1 needs collectives: the tied
embedding's gradient summed over the pipeline ends, the global gradient norm (clipping) and
the step loss summed over the stages, and the data-parallel gradient average. A blocking
collective in the middle of a pipeline that never flushes deadlocks under rendezvous sends:
rank r waits in the collective while its neighbour waits for r to receive an activation that
r only posts after the collective. The STEP action therefore only *seals* step k's gradients;
the update runs later, at a point where no message is in flight.

Version k+1 is first needed by the first forward of step k+2, so the update of step k can wait
until just before that forward (before the communication batch that precedes it). This
module picks those points and proves that, taken together over all ranks, they form a
*consistent cut*: every point-to-point message is sent and received on the same side of it.
Then every rank reaches its point without needing anything another rank does after its own
point (each side of a cut is a complete schedule), so collectives there cannot deadlock,
under buffered or rendezvous sends alike. With m >= p there is always such a cut; the check
is run on every schedule the runtime executes. Steps k >= steps-2 are updated at the end.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from plait.schedule.actions import Kind, Schedule, comm_batches
from plait.schedule.validate import match_messages

WINDOW = 2
"""Messages of steps k-WINDOW..k+WINDOW+1 are placed exactly around step k's cut; the others
are checked, in O(1) per rank and step, to lie wholly before or after it."""


@dataclass(frozen=True)
class _Index:
    """One pass over a schedule: what every cut needs, so a run of S steps costs O(S)."""

    starts: list[list[int]]  # per rank: start index of every comm batch / compute
    first_f: list[dict[int, int]]  # per rank: step -> index of its first forward
    sealed: list[dict[int, int]]  # per rank: step -> index of its STEP
    by_step: dict[int, list[tuple[int, int, int, int]]]  # step -> (src, send, dst, recv)
    last_upto: list[list[int]]  # per rank: last comm index of steps <= s (-1: none)
    first_from: list[list[int]]  # per rank: first comm index of steps >= s (huge: none)

    @classmethod
    def of(cls, s: Schedule) -> _Index:
        by_step: dict[int, list[tuple[int, int, int, int]]] = {}
        for (dst, recv), (src, send) in match_messages(s).items():
            by_step.setdefault(s.ranks[dst][recv].step, []).append((src, send, dst, recv))
        first_f: list[dict[int, int]] = [{} for _ in range(s.p)]
        sealed: list[dict[int, int]] = [{} for _ in range(s.p)]
        last = [[-1] * s.steps for _ in range(s.p)]
        first = [[1 << 62] * (s.steps + 1) for _ in range(s.p)]
        for rank, acts in enumerate(s.ranks):
            for i, a in enumerate(acts):
                if a.kind is Kind.F:
                    first_f[rank].setdefault(a.step, i)
                elif a.kind is Kind.STEP:
                    sealed[rank][a.step] = i
                elif a.is_comm:
                    last[rank][a.step] = max(last[rank][a.step], i)
                    first[rank][a.step] = min(first[rank][a.step], i)
            for k in range(1, s.steps):
                last[rank][k] = max(last[rank][k], last[rank][k - 1])
            for k in reversed(range(s.steps)):
                first[rank][k] = min(first[rank][k], first[rank][k + 1])
        starts = [[rng.start for rng in comm_batches(acts)] for acts in s.ranks]
        return cls(starts, first_f, sealed, by_step, last, first)


def update_cut(schedule: Schedule, step: int, index: _Index | None = None) -> list[int] | None:
    """Per rank, the action index before which step `step`'s update runs; None: at the end.

    Start from the latest possible point on each rank, the communication batch right before
    its first forward of step `step` + 2, and move points back, one batch at a time, while a
    message crosses the cut (its sender's or receiver's point goes before it): the latest
    consistent cut below the bound. Every point must still follow the rank's STEP `step`,
    which seals the gradients the update consumes.
    """
    if step + 2 >= schedule.steps:
        return None
    ix = _Index.of(schedule) if index is None else index
    cut = [
        _bound(schedule.ranks[r], ix.starts[r], ix.first_f[r][step + 2]) for r in range(schedule.p)
    ]
    near = [m for k in range(step - WINDOW, step + WINDOW + 2) for m in ix.by_step.get(k, [])]
    moved = True
    while moved:
        moved = False
        for src, send, dst, recv in near:
            if (send < cut[src]) != (recv < cut[dst]):
                rank, i = (src, send) if send < cut[src] else (dst, recv)
                cut[rank] = ix.starts[rank][bisect_right(ix.starts[rank], i) - 1]  # its batch
                moved = True
    _check_far_and_sealed(schedule, ix, step, cut)
    return cut


def _bound(acts, starts: list[int], first_f: int) -> int:
    """Start of the batch before the forward `first_f` if it communicates, else the forward."""
    b = bisect_right(starts, first_f) - 1
    return starts[b - 1] if b and acts[starts[b - 1]].is_comm else first_f


def _check_far_and_sealed(s: Schedule, ix: _Index, step: int, cut: list[int]) -> None:
    before, after = step - WINDOW - 1, step + WINDOW + 2
    for rank in range(s.p):
        far = (before >= 0 and ix.last_upto[rank][before] >= cut[rank]) or (
            after < s.steps and ix.first_from[rank][after] < cut[rank]
        )
        if far or cut[rank] <= ix.sealed[rank][step]:
            raise AssertionError(
                f"{s.name} p={s.p} m={s.m}: no consistent cut for the update of step {step} "
                f"between rank {rank}'s STEP and its first forward of step {step + 2} "
                f"(cut {cut})"
            )


def check_cut(schedule: Schedule, cut: list[int]) -> None:
    """Raise AssertionError unless every message is sent and received on one side of `cut`."""
    for (dst, recv), (src, send) in match_messages(schedule).items():
        if (send < cut[src]) != (recv < cut[dst]):
            raise AssertionError(
                f"{schedule.name} p={schedule.p} m={schedule.m}: update cut {cut} separates "
                f"rank {src} action {send} ({schedule.ranks[src][send]}) from rank {dst} "
                f"action {recv} ({schedule.ranks[dst][recv]})"
            )


def update_points(schedule: Schedule) -> list[dict[int, list[int]]]:
    """For each rank: {action index: steps whose update runs just before it}, cuts checked.

    Steps missing from every map (the last two) are updated after the action list ends.
    """
    ix = _Index.of(schedule)
    points: list[dict[int, list[int]]] = [{} for _ in range(schedule.p)]
    for step in range(schedule.steps - 2):
        for rank, i in enumerate(update_cut(schedule, step, ix)):
            points[rank].setdefault(i, []).append(step)
    return points
