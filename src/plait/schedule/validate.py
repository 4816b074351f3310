"""Prove a schedule dependency-correct and deadlock-free, without processes.

`validate` checks, and raises ScheduleError naming rank, action index and reason:

1. fields: chunks, micro-batches and steps in range; communication names the right peer;
2. matching: between each ordered pair of ranks the i-th send is received by the i-th receive
   (point-to-point libraries match by order per pair; NCCL ignores tags), same tensor;
3. local order on each rank: F after its input was received; B after its F and its output
   gradient; W after B; sends after the compute that made the tensor; STEP after every
   backward of its step; weight versions (2bw) produced before use and equal for F and B;
4. completeness: one F, one B (and one W iff split) per micro-batch, chunk and step;
5. deadlock-freedom, by running the lists with blocking receives under two runtime models
   (`execution_order`), both of which must finish.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import product

from plait.schedule.actions import Action, Kind, Schedule, comm_batches

Slot = tuple[int, int]
"""(rank, index in that rank's action list)."""


class ScheduleError(ValueError):
    """A schedule that is wrong: the message names schedule, rank, action index and reason."""

    def __init__(
        self, schedule: Schedule, reason: str, rank: int | None = None, index: int | None = None
    ) -> None:
        self.rank, self.index, self.reason = rank, index, reason
        where = f"{schedule.name} p={schedule.p} m={schedule.m} v={schedule.v}"
        if rank is not None:
            where += f": rank {rank}"
        if rank is not None and index is not None:
            where += f", action {index} ({schedule.ranks[rank][index]})"
        super().__init__(f"{where}: {reason}")


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless the schedule is correct and deadlock-free (see module doc)."""
    if len(schedule.ranks) != schedule.p:
        raise ScheduleError(schedule, f"{len(schedule.ranks)} action lists for p={schedule.p}")
    _check_fields(schedule)
    matches = match_messages(schedule)
    versions: dict[tuple[int, int], int | None] = {}
    for rank in range(schedule.p):
        _check_order(schedule, rank, versions)
    _check_complete(schedule)
    execution_order(schedule, matches, batched=False)
    execution_order(schedule, matches, batched=True)


def _check_fields(s: Schedule) -> None:
    for rank, acts in enumerate(s.ranks):
        for i, a in enumerate(acts):
            reason = _field_problem(s, rank, a)
            if reason:
                raise ScheduleError(s, reason, rank, i)


def _field_problem(s: Schedule, rank: int, a: Action) -> str | None:
    if not 0 <= a.step < s.steps:
        return f"step {a.step} outside 0..{s.steps - 1}"
    if a.kind is not Kind.STEP and not (0 <= a.microbatch < s.m and 0 <= a.chunk < s.v):
        return f"micro-batch {a.microbatch} or chunk {a.chunk} outside m={s.m}, v={s.v}"
    if a.kind is Kind.W and not s.split_backward:
        return "W in a schedule whose B also computes weight gradients (split_backward False)"
    versioned = a.kind in (Kind.F, Kind.B, Kind.W, Kind.STEP)
    if s.weight_versions and versioned and (a.version is None or a.version < 0):
        return "needs a weight version (weight_versions is on)"
    if not s.weight_versions and a.version is not None:
        return "carries a weight version but the schedule holds one version"
    if not a.is_comm:
        return None if a.peer is None else "only communication actions name a peer"
    expected = s.expected_peer(rank, a)
    if expected is None:
        return f"stage {s.stage(rank, a.chunk)} has no neighbour on that side"
    if a.peer != expected:
        return f"peer should be rank {expected} (the neighbouring stage), got {a.peer}"
    return None


def match_messages(s: Schedule) -> dict[Slot, Slot]:
    """Pair every receive with its send: the i-th receive on dst from src takes src's i-th send
    to dst. Returns {receive slot: send slot}; ScheduleError if the pairs disagree."""
    sends: dict[tuple[int, int], list[Slot]] = {}
    recvs: dict[tuple[int, int], list[Slot]] = {}
    for rank, acts in enumerate(s.ranks):
        for i, a in enumerate(acts):
            if a.is_send:
                sends.setdefault((rank, a.peer), []).append((rank, i))
            elif a.is_recv:
                recvs.setdefault((a.peer, rank), []).append((rank, i))
    matches: dict[Slot, Slot] = {}
    for pair in sorted(set(sends) | set(recvs)):
        out, into = sends.get(pair, []), recvs.get(pair, [])
        _match_pair(s, pair, out, into)
        matches.update(zip(into, out, strict=True))
    return matches


def _match_pair(s: Schedule, pair: tuple[int, int], out: list[Slot], into: list[Slot]) -> None:
    src, dst = pair

    def msg(slot: Slot):
        return s.message(slot[0], s.ranks[slot[0]][slot[1]])

    sent, received = [msg(x) for x in out], [msg(x) for x in into]
    for k in range(max(len(out), len(into))):
        if k < len(out) and k < len(into) and sent[k] == received[k]:
            continue
        if k >= len(into) or (k < len(out) and sent[k] not in received):
            raise ScheduleError(s, f"no matching receive on rank {dst}", *out[k])
        if k >= len(out) or received[k] not in sent:
            raise ScheduleError(s, f"no matching send on rank {src}", *into[k])
        raise ScheduleError(
            s,
            f"receive #{k} from rank {src} gets rank {src}'s send #{k}, "
            f"{s.ranks[src][out[k][1]]} (action {out[k][1]}): sends and receives between "
            "two ranks must come in the same order",
            *into[k],
        )


@dataclass
class _Walk:
    """What one rank has done so far while its list is checked front to back."""

    done: set[tuple[Kind, int, int, int]] = field(default_factory=set)
    fwd_version: dict[tuple[int, int, int], int | None] = field(default_factory=dict)
    backwards: Counter[int] = field(default_factory=Counter)
    latest: int = 0
    steps_done: int = 0


def _check_order(s: Schedule, rank: int, versions: dict[tuple[int, int], int | None]) -> None:
    """Walk one rank's list and check each action's local prerequisites (module doc, item 3).

    `versions` carries each micro-batch's weight version across ranks: all stages must agree.
    """
    walk = _Walk()
    for i, a in enumerate(s.ranks[rank]):
        reason = _order_problem(s, rank, a, walk, versions)
        if reason:
            raise ScheduleError(s, reason, rank, i)
        if a.kind is Kind.STEP:
            walk.latest, walk.steps_done = (a.version or 0), walk.steps_done + 1
            continue
        if a.kind is Kind.F:
            walk.fwd_version[(a.step, a.microbatch, a.chunk)] = a.version
        if a.kind in (Kind.B, Kind.W):
            walk.backwards[a.step] += 1
        walk.done.add((a.kind, a.step, a.microbatch, a.chunk))


def _needs(s: Schedule, rank: int, a: Action) -> list[tuple[Kind, str]]:
    """The earlier actions on this rank, for the same micro-batch and chunk, that `a` needs."""
    stage = s.stage(rank, a.chunk)
    if a.kind is Kind.F:
        return [(Kind.RECV_F, "forward before its input was received (RECV_F)")] * (stage > 0)
    if a.kind is Kind.B:
        needs = [(Kind.F, "backward before its forward")]
        if stage < s.num_stages - 1:
            needs.append((Kind.RECV_B, "backward before its output gradient was received (RECV_B)"))
        return needs
    return {
        Kind.W: [(Kind.B, "weight gradient (W) before the input gradient (B)")],
        Kind.SEND_F: [(Kind.F, "sends activations before the forward computed them")],
        Kind.SEND_B: [(Kind.B, "sends a gradient before the backward computed it")],
    }.get(a.kind, [])


def _order_problem(
    s: Schedule, rank: int, a: Action, walk: _Walk, versions: dict[tuple[int, int], int | None]
) -> str | None:
    if a.kind is Kind.STEP:
        return _step_problem(s, a, walk)
    key = (a.step, a.microbatch, a.chunk)
    if (a.kind, *key) in walk.done:
        return "duplicate action"
    for kind, reason in _needs(s, rank, a):
        if (kind, *key) not in walk.done:
            return reason
    if a.kind is Kind.F:
        return _forward_version_problem(s, a, walk, versions)
    if a.kind is Kind.B and a.version != walk.fwd_version[key]:
        return f"backward with version {a.version}, forward used {walk.fwd_version[key]}"
    return None


def _step_problem(s: Schedule, a: Action, walk: _Walk) -> str | None:
    if a.step != walk.steps_done:
        return f"optimizer step for step {a.step}, expected step {walk.steps_done}"
    expected = s.m * s.v * (2 if s.split_backward else 1)
    if walk.backwards[a.step] != expected:
        return f"before all backwards of step {a.step} ({walk.backwards[a.step]} of {expected})"
    if s.weight_versions and a.version != walk.latest + 1:
        return f"produces version {a.version}, expected {walk.latest + 1}"
    return None


def _forward_version_problem(
    s: Schedule, a: Action, walk: _Walk, versions: dict[tuple[int, int], int | None]
) -> str | None:
    """Synchronous schedules flush: step k's forwards wait for step k-1's optimizer step.
    Versioned (2bw) ones may not: a forward uses a version already produced on this rank, and
    the same one as the micro-batch's other stages."""
    if not s.weight_versions:
        if a.step > walk.steps_done:
            return f"forward of step {a.step} before the optimizer step of step {a.step - 1}"
        return None
    assert a.version is not None  # _check_fields
    if a.version > walk.latest:
        return f"uses weight version {a.version}, not produced yet (latest {walk.latest})"
    agreed = versions.setdefault((a.step, a.microbatch), a.version)
    if agreed != a.version:
        return f"other stages run this micro-batch with version {agreed}"
    return None


def _wanted(s: Schedule, stage: int) -> dict[Kind, int]:
    """How many of each action one (step, micro-batch) needs on a stage."""
    first, last = stage == 0, stage == s.num_stages - 1
    return {
        Kind.F: 1,
        Kind.B: 1,
        Kind.W: int(s.split_backward),
        Kind.RECV_F: int(not first),
        Kind.SEND_B: int(not first),
        Kind.SEND_F: int(not last),
        Kind.RECV_B: int(not last),
    }


def _check_complete(s: Schedule) -> None:
    """Every (step, micro-batch, chunk) has exactly the actions its stage needs, once."""
    for rank, acts in enumerate(s.ranks):
        have = Counter((a.kind, a.step, a.microbatch, a.chunk) for a in acts)
        steps = Counter(a.step for a in acts if a.kind is Kind.STEP)
        for k, mb, c in product(range(s.steps), range(s.m), range(s.v)):
            for kind, want in _wanted(s, s.stage(rank, c)).items():
                if have[(kind, k, mb, c)] != want:
                    n = have[(kind, k, mb, c)]
                    raise ScheduleError(
                        s,
                        f"{n} {kind.value} for micro-batch {mb} chunk {c} step {k}, "
                        f"expected {want}",
                        rank,
                    )
        for k in range(s.steps):
            if steps[k] != 1:
                raise ScheduleError(s, f"{steps[k]} optimizer steps for step {k}, expected 1", rank)


def execution_order(s: Schedule, matches: Mapping[Slot, Slot], *, batched: bool) -> list[Slot]:
    """Run the lists with blocking receives; return the order actions ran in, or raise on deadlock.

    batched=False: actions run one at a time; a SEND completes at once (buffered, as an isend
    the runtime waits for later) and a RECV blocks until its send ran. batched=True: each run of
    consecutive communication actions is posted as one batch (batch_isend_irecv) and completes
    only when every partner operation has been posted (rendezvous, the NCCL worst case).
    A schedule the runtime may execute either way must pass both.
    """
    order, pos = _run_blocking(s, matches, batched=batched)
    if len(order) < sum(len(a) for a in s.ranks):
        _raise_deadlock(s, pos, matches, batched)
    return order


def _run_blocking(
    s: Schedule, matches: Mapping[Slot, Slot], *, batched: bool
) -> tuple[list[Slot], list[int]]:
    """The engine of execution_order: (actions in the order they ran, where each rank stopped).

    Where a rank stopped short of its list's end it is blocked for good (deadlock).
    """
    partner = _partners(matches)
    group_start, group_end = _comm_groups(s, batched)
    pos = [0] * s.p
    order: list[Slot] = []
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(s.ranks):
            while pos[r] < len(acts):
                i, end = pos[r], group_end[r][pos[r]]
                if any(
                    _blocked(s, (r, j), partner, pos, group_start, batched) for j in range(i, end)
                ):
                    break
                order += [(r, j) for j in range(i, end)]
                pos[r], progress = end, True
    return order, pos


def _partners(matches: Mapping[Slot, Slot]) -> dict[Slot, Slot]:
    return {**matches, **{send: recv for recv, send in matches.items()}}


def _blocked(
    s: Schedule,
    slot: Slot,
    partner: Mapping[Slot, Slot],
    pos: list[int],
    group_start: list[list[int]],
    batched: bool,
) -> bool:
    """Whether this action cannot complete yet: a receive whose send has not run (buffered) or
    a send/receive whose partner's batch has not been posted (batched rendezvous)."""
    a = s.ranks[slot[0]][slot[1]]
    if not (a.is_recv or (batched and a.is_send)):
        return False
    r, j = partner[slot]
    return pos[r] < group_start[r][j] if batched else pos[r] <= j


def _comm_groups(s: Schedule, batched: bool) -> tuple[list[list[int]], list[list[int]]]:
    """For each slot, the first index and the end (exclusive) of the batch it is posted in:
    with batched=True its run of consecutive communication actions (comm_batches), else itself."""
    starts, ends = [], []
    for acts in s.ranks:
        batches = comm_batches(acts) if batched else [range(j, j + 1) for j in range(len(acts))]
        starts.append([b.start for b in batches for _ in b])
        ends.append([b.stop for b in batches for _ in b])
    return starts, ends


def _raise_deadlock(s: Schedule, pos: list[int], matches: Mapping[Slot, Slot], batched: bool):
    """Name, for every blocked rank, the action it waits on and the peer action it waits for."""
    partner = _partners(matches)
    group_start, group_end = _comm_groups(s, batched)
    waits: list[str] = []
    first: Slot | None = None
    for r in range(s.p):
        if pos[r] == len(s.ranks[r]):
            continue
        for j in range(pos[r], group_end[r][pos[r]]):
            if _blocked(s, (r, j), partner, pos, group_start, batched):
                pr, pj = partner[(r, j)]
                waits.append(
                    f"rank {r} action {j} ({s.ranks[r][j]}) waits for rank {pr} action {pj} "
                    f"({s.ranks[pr][pj]})"
                )
                first = first or (r, j)
                break
    mode = "batched rendezvous sends" if batched else "buffered sends"
    assert first is not None
    raise ScheduleError(s, f"deadlock with {mode}: " + "; ".join(waits), *first)
