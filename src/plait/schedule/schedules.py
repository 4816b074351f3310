"""Pipeline schedules as pure functions (p, m, v) -> Schedule.

Each builder only decides the order of compute on every rank (F, B, W, STEP), written as
warmup / steady / cooldown. `_with_communication` then inserts the point-to-point actions the
same way for every schedule: a SEND right after the compute that produced the tensor, and the
RECVs right before the compute that needs them (earlier where rendezvous sends need it), in the
order the peer sends (see there why).
`validate.validate` proves the result; tests run it over a grid of sizes.

Naive model parallelism is the baseline every course starts from. Papers: GPipe (Huang et
al., 2019); 1F1B (PipeDream-Flush, Narayanan et al., 2021);
interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters", 2021); ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023); PipeDream-2BW
(Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", 2021).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from plait.errors import ConfigError
from plait.schedule.actions import Action, Kind, Message, Schedule

Builder = Callable[..., Schedule]


def _check_sizes(name: str, p: int, m: int, v: int) -> None:
    for label, value in (("p (pipeline stages)", p), ("m (micro-batches)", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}: {label} must be a positive integer, got {value!r}")


def _check_no_interleave(name: str, p: int, m: int, v: int) -> None:
    _check_sizes(name, p, m, v)
    if v != 1:
        raise ConfigError(
            f"{name} does not interleave: virtual stages v must be 1, got v={v} "
            "(use --schedule interleaved for v > 1)"
        )


def _one_f_one_b(forwards: Sequence[Action], backwards: Sequence[Action], warmup: int) -> list:
    """Warmup forwards, then alternate one forward and one backward, then drain the backwards.

    This is the whole of 1F1B; interleaving, zero-bubble and 2BW differ only in what the
    sequences hold and how deep the warmup is.
    """
    warmup = min(warmup, len(forwards))
    out = list(forwards[:warmup])  # warmup: fill the pipe
    for i, f in enumerate(forwards[warmup:]):  # steady: one forward, one backward
        out += [f, backwards[i]]
    out += backwards[len(forwards) - warmup :]  # cooldown: drain
    return out


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """All forwards, then all backwards (GPipe): m micro-batches in flight on every rank."""
    _check_no_interleave("gpipe", p, m, v)
    ranks = []
    for _ in range(p):
        forwards = [Action(Kind.F, i) for i in range(m)]
        backwards = [Action(Kind.B, i) for i in range(m)]
        ranks.append([*forwards, *backwards, Action(Kind.STEP)])
    return _with_communication("gpipe", p, m, 1, ranks)


def naive(p: int, m: int, v: int = 1) -> Schedule:
    """Naive model parallelism: each micro-batch makes the whole round trip, forward through
    every stage and backward through them again, before the next one starts; one stage works
    at a time, so the bubble is (p-1)/p whatever m is. 1F1B without a warmup: the baseline the
    pipelined schedules are measured against."""
    _check_no_interleave("naive", p, m, v)
    forwards = [Action(Kind.F, i) for i in range(m)]
    backwards = [Action(Kind.B, i) for i in range(m)]
    ranks = [[*_one_f_one_b(forwards, backwards, 0), Action(Kind.STEP)] for _ in range(p)]
    return _with_communication("naive", p, m, 1, ranks)


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B: rank r runs p-r-1 warmup forwards, then alternates; at most p-r in flight."""
    _check_no_interleave("1f1b", p, m, v)
    ranks = []
    for r in range(p):
        forwards = [Action(Kind.F, i) for i in range(m)]
        backwards = [Action(Kind.B, i) for i in range(m)]
        ranks.append([*_one_f_one_b(forwards, backwards, p - r - 1), Action(Kind.STEP)])
    return _with_communication("1f1b", p, m, 1, ranks)


def interleaved(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron): 1F1B over "virtual micro-batches" that visit v chunks.

    Forwards go through micro-batches in groups of p, chunk by chunk: group g runs micro-batches
    g·p..g·p+p-1 on chunk 0, then the same ones on chunk 1, and so on; backwards mirror it from
    the last chunk. The warmup is deeper than 1F1B's, 2(p-r-1) + (v-1)p, so the pipe stays full
    of smaller chunks; with m == p every forward is warmup (Megatron does the same).
    """
    _check_sizes("interleaved", p, m, v)
    if v < 2:
        raise ConfigError(f"interleaved needs v >= 2 virtual stages per rank, got v={v}")
    if p < 2:
        raise ConfigError(f"interleaved needs p >= 2 pipeline stages, got p={p}")
    if m % p:
        raise ConfigError(f"interleaved needs micro-batches m a multiple of p, got m={m}, p={p}")

    def virtual(k: int, backward: bool) -> Action:
        group, k_in_group = divmod(k, p * v)
        chunk = k_in_group // p
        mb = group * p + k % p
        if backward:
            return Action(Kind.B, mb, v - 1 - chunk)
        return Action(Kind.F, mb, chunk)

    ranks = []
    for r in range(p):
        forwards = [virtual(k, False) for k in range(m * v)]
        backwards = [virtual(k, True) for k in range(m * v)]
        warmup = m * v if m == p else 2 * (p - r - 1) + (v - 1) * p
        ranks.append([*_one_f_one_b(forwards, backwards, warmup), Action(Kind.STEP)])
    return _with_communication("interleaved", p, m, v, ranks)


def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 (Qi et al., 2023): 1F1B with the backward split into B (input grad) and W (weights).

    Only B is on the critical path between stages, so gradients reach rank 0 sooner; each
    rank r defers its W's by r backwards to fill the cooldown bubble. Rank r then holds at most
    (p-r) + r = p micro-batches whose W is pending, the same peak as 1F1B's rank 0.
    """
    _check_no_interleave("zb-h1", p, m, v)
    ranks = []
    for r in range(p):
        forwards = [Action(Kind.F, i) for i in range(m)]
        backwards = [Action(Kind.B, i) for i in range(m)]
        order = _one_f_one_b(forwards, backwards, p - r - 1)
        ranks.append([*_defer_weight_grads(order, lag=r), Action(Kind.STEP)])
    return _with_communication("zb-h1", p, m, 1, ranks, split_backward=True)


def _defer_weight_grads(order: Sequence[Action], lag: int) -> list[Action]:
    """Put micro-batch j's W right after the (j+lag)-th B; the last `lag` W's go at the end."""
    out: list[Action] = []
    done_b: list[Action] = []
    for a in order:
        out.append(a)
        if a.kind is Kind.B:
            done_b.append(a)
            if len(done_b) > lag:
                out.append(_w_of(done_b[len(done_b) - 1 - lag]))
    out += [_w_of(b) for b in done_b[max(len(done_b) - lag, 0) :]]
    return out


def _w_of(b: Action) -> Action:
    return Action(Kind.W, b.microbatch, b.chunk, step=b.step, version=b.version)


def two_bw(p: int, m: int, v: int = 1, steps: int = 2) -> Schedule:
    """PipeDream-2BW: 1F1B that never flushes, with two weight versions (double buffering).

    Micro-batches stream through `steps` optimizer steps back to back. Step k's micro-batches
    run forward and backward with version max(k-1, 0); after its last backward a rank's STEP
    produces version k+1 from step k's gradients applied to version k, which is
    W(k+1) = W(k) - lr·grad f(W(k-1)): the one-step-delayed update of the paper. Version k+1 is
    first used by step k+2, whose forwards start after that STEP on every rank when m >= p,
    so each rank holds at most two versions.
    """
    _check_no_interleave("2bw", p, m, v)
    if m < p:
        raise ConfigError(
            f"2bw needs micro-batches m >= p so two weight versions suffice, got m={m}, p={p}"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"2bw: steps must be a positive integer, got {steps!r}")
    stream = [(k, i) for k in range(steps) for i in range(m)]
    ranks = []
    for r in range(p):
        forwards = [Action(Kind.F, i, step=k, version=max(k - 1, 0)) for k, i in stream]
        backwards = [Action(Kind.B, i, step=k, version=max(k - 1, 0)) for k, i in stream]
        order = []
        for a in _one_f_one_b(forwards, backwards, p - r - 1):
            order.append(a)
            if a.kind is Kind.B and a.microbatch == m - 1:  # step a.step's gradients complete
                order.append(Action(Kind.STEP, step=a.step, version=a.step + 1))
        ranks.append(order)
    return _with_communication("2bw", p, m, 1, ranks, steps=steps, weight_versions=True)


def _with_communication(
    name: str, p: int, m: int, v: int, compute: Sequence[Sequence[Action]], **flags
) -> Schedule:
    """Insert SEND/RECV actions around the compute order of every rank.

    A SEND follows the compute producing its tensor; the RECVs a compute needs go right before
    it. Receives are posted in the order the peer sent (point-to-point libraries match by order
    per pair of ranks; NCCL ignores tags), so taking the k-th message from a peer first takes
    the ones before it. Where that alone would deadlock with rendezvous sends, a receive is
    posted earlier (see _Placer).
    """
    draft = Schedule(name, p, m, v, (), **flags)
    with_sends = [_add_sends(draft, r, acts) for r, acts in enumerate(compute)]
    return replace(draft, ranks=_Placer(draft, with_sends).run())


def _add_sends(s: Schedule, rank: int, compute: Sequence[Action]) -> list[Action]:
    out = []
    for a in compute:
        out.append(a)
        send = {Kind.F: Kind.SEND_F, Kind.B: Kind.SEND_B}.get(a.kind)
        peer = None if send is None else s.expected_peer(rank, Action(send, chunk=a.chunk))
        if peer is not None:
            out.append(Action(send, a.microbatch, a.chunk, peer, a.step))
    return out


class _Placer:
    """Place receives by running all ranks against each other as the NCCL-safe runtime would.

    Each rank posts the communication between two computes as one batch, which completes only
    when every partner operation is posted (rendezvous). A rank blocks at an incomplete batch;
    when every rank is blocked, each waiting send gets its receive posted early in the peer's
    open batch, as Megatron does for interleaved 1F1B (its batches receive the next input).
    """

    def __init__(self, s: Schedule, todo: Sequence[Sequence[Action]]) -> None:
        self.s, self.todo = s, todo
        self.cursor = [0] * s.p
        self.out: list[list[Action]] = [[] for _ in range(s.p)]
        self.batch: list[list[tuple[Action, tuple[int, int], int]]] = [[] for _ in range(s.p)]
        self.queues: dict[tuple[int, int], list[Message]] = {}
        for r, acts in enumerate(todo):
            for a in acts:
                if a.is_send:
                    self.queues.setdefault((r, a.peer), []).append(s.message(r, a))
        self.where = {ch: {msg: k for k, msg in enumerate(q)} for ch, q in self.queues.items()}
        self.posted: Counter[tuple[int, int]] = Counter()  # sends posted per (src, dst)
        self.taken: Counter[tuple[int, int]] = Counter()  # receives posted per (src, dst)

    def run(self) -> tuple[tuple[Action, ...], ...]:
        while any(self.cursor[r] < len(self.todo[r]) or self.batch[r] for r in range(self.s.p)):
            if not any([self.advance(r) for r in range(self.s.p)]) and not self.prefetch():
                raise AssertionError(f"{self.s.name}: cannot place receives without deadlock")
        return tuple(tuple(acts) for acts in self.out)

    def advance(self, r: int) -> bool:
        """Run rank r until it blocks or ends; whether anything happened."""
        moved, todo = False, self.todo[r]
        while True:
            nxt = todo[self.cursor[r]] if self.cursor[r] < len(todo) else None
            if nxt is not None and nxt.is_send:
                channel = (r, nxt.peer)
                self.batch[r].append((nxt, channel, self.posted[channel]))
                self.posted[channel] += 1
                self.cursor[r], moved = self.cursor[r] + 1, True
                continue
            if nxt is not None:
                self.receive_input(r, nxt)
            if (nxt is None and not self.batch[r]) or not self.complete(r):
                return moved
            self.out[r] += [a for a, _, _ in self.batch[r]]
            self.batch[r] = []
            if nxt is not None:
                self.out[r].append(nxt)
                self.cursor[r] += 1
            moved = True

    def receive_input(self, r: int, a: Action) -> None:
        recv = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B}.get(a.kind)
        probe = Action(recv or a.kind, a.microbatch, a.chunk, step=a.step)
        src = None if recv is None else self.s.expected_peer(r, probe)
        if src is not None:
            self.take(r, src, self.where[(src, r)][self.s.message(r, probe)])

    def take(self, r: int, src: int, k: int) -> None:
        """Post on rank r the receives of messages from src up to the k-th, in order."""
        channel = (src, r)
        while self.taken[channel] <= k:
            msg = self.queues[channel][self.taken[channel]]
            self.batch[r].append((_recv_for(self.s, msg, src), channel, self.taken[channel]))
            self.taken[channel] += 1

    def complete(self, r: int) -> bool:
        """Every send's receive and every receive's send in r's batch has been posted."""
        return all(
            (self.taken if a.is_send else self.posted)[channel] > k
            for a, channel, k in self.batch[r]
        )

    def prefetch(self) -> bool:
        """All ranks blocked: post the receive of every waiting send in the peer's open batch."""
        moved = False
        for r in range(self.s.p):
            for a, (src, dst), k in list(self.batch[r]):
                if a.is_send and self.taken[(src, dst)] <= k:
                    self.take(dst, src, k)
                    moved = True
        return moved


def _recv_for(s: Schedule, msg: Message, peer: int) -> Action:
    """The RECV action matching a message, on the receiving side of its boundary."""
    if msg.kind is Kind.F:
        return Action(Kind.RECV_F, msg.microbatch, s.location(msg.edge + 1)[1], peer, msg.step)
    return Action(Kind.RECV_B, msg.microbatch, s.location(msg.edge)[1], peer, msg.step)


def _registry() -> Mapping[str, Builder]:
    return MappingProxyType(
        {
            "naive": naive,
            "gpipe": gpipe,
            "1f1b": one_f_one_b,
            "interleaved": interleaved,
            "zb-h1": zb_h1,
            "2bw": two_bw,
        }
    )


SCHEDULES: Mapping[str, Builder] = _registry()
"""Schedule name -> builder (p, m, v, **options) -> Schedule. Read-only."""


def build_schedule(name: str, p: int, m: int, v: int = 1, **options) -> Schedule:
    """Build a schedule by name; ConfigError listing the known names for an unknown one."""
    builder = SCHEDULES.get(name)
    if builder is None:
        raise ConfigError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return builder(p, m, v, **options)
