"""The vocabulary of pipeline schedules: actions, messages, schedules and timed actions.

A schedule is data, not code (DeepSpeed's lesson): for every pipeline rank an ordered tuple of
actions. A runtime walks one rank's tuple front to back, running each compute action and posting
each communication action; the validator and the simulator read the same tuples without
processes. Nothing here imports torch.

Stages. With v virtual chunks per rank the model is cut into p·v stages and rank r holds chunks
0..v-1, chunk c being global stage c·p + r (Megatron's interleaving): activations go from rank r
to rank r+1, and from the last rank back to rank 0 for the next chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property


class Kind(str, Enum):
    """What an action does; the string value is what traces and `__str__` print."""

    F = "F"
    """Forward of one micro-batch through one chunk."""
    B = "B"
    """Backward for the chunk's input. Where the schedule does not split the backward
    (Schedule.split_backward False) it also computes the weight gradients."""
    W = "W"
    """Backward for the weights only (zero-bubble schedules): needs the B's saved tensors."""
    SEND_F = "SEND_F"
    """Send a forward output (activations) to the next stage."""
    RECV_F = "RECV_F"
    """Receive a forward input (activations) from the previous stage."""
    SEND_B = "SEND_B"
    """Send an input gradient to the previous stage."""
    RECV_B = "RECV_B"
    """Receive an output gradient from the next stage."""
    STEP = "STEP"
    """Optimizer step over every chunk on the rank (for 2bw: produces a new weight version)."""


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.W})
SEND_KINDS = frozenset({Kind.SEND_F, Kind.SEND_B})
RECV_KINDS = frozenset({Kind.RECV_F, Kind.RECV_B})


@dataclass(frozen=True)
class Action:
    """One entry of a rank's action list.

    `microbatch` and `chunk` are ignored for STEP. `peer` is the other rank of a communication
    action (None otherwise). `step` numbers optimizer steps for schedules that show several
    (2bw); `version` is the weight version an F/B runs with, or the version a STEP produces,
    and None in synchronous schedules, which hold one version.
    """

    kind: Kind
    microbatch: int = 0
    chunk: int = 0
    peer: int | None = None
    step: int = 0
    version: int | None = None

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECV_KINDS

    @property
    def is_comm(self) -> bool:
        return self.is_send or self.is_recv

    def __str__(self) -> str:
        """`F3.1`: micro-batch 3, chunk 1; `SEND_F3.1>2` to rank 2; `RECV_B3.1<2` from rank 2."""
        if self.kind is Kind.STEP:
            text = "STEP"
        else:
            text = f"{self.kind.value}{self.microbatch}.{self.chunk}"
            if self.peer is not None:
                text += (">" if self.is_send else "<") + str(self.peer)
        if self.step:
            text += f" s{self.step}"
        if self.version is not None:
            text += f" v{self.version}"
        return text


@dataclass(frozen=True)
class Message:
    """One point-to-point transfer, the same on both ends: which tensor crosses which boundary.

    `kind` is Kind.F for activations, Kind.B for gradients; `edge` is the boundary between
    global stages edge and edge+1.
    """

    kind: Kind
    step: int
    microbatch: int
    edge: int


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists plus the facts a runtime needs to run them.

    `ranks[r]` is rank r's ordered actions. `split_backward`: B and W are separate actions.
    `steps`: how many optimizer steps the lists cover (1 except for 2bw). `weight_versions`:
    F/B/STEP carry weight versions (asynchronous 2bw).
    """

    name: str
    p: int
    m: int
    v: int
    ranks: tuple[tuple[Action, ...], ...]
    split_backward: bool = False
    steps: int = 1
    weight_versions: bool = False

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """Global stage of a rank's chunk: chunk·p + rank (Megatron's interleaved placement)."""
        return chunk * self.p + rank

    def location(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding a global stage; the inverse of stage()."""
        return stage % self.p, stage // self.p

    def message(self, rank: int, action: Action) -> Message:
        """The transfer a communication action on `rank` sends or receives."""
        s = self.stage(rank, action.chunk)
        edge = {
            Kind.SEND_F: s,
            Kind.RECV_F: s - 1,
            Kind.SEND_B: s - 1,
            Kind.RECV_B: s,
        }[action.kind]
        family = Kind.F if action.kind in (Kind.SEND_F, Kind.RECV_F) else Kind.B
        return Message(family, action.step, action.microbatch, edge)

    def expected_peer(self, rank: int, action: Action) -> int | None:
        """The rank on the other side of a communication action's boundary (None: no such
        stage, e.g. RECV_F on stage 0)."""
        s = self.stage(rank, action.chunk)
        other = s + 1 if action.kind in (Kind.SEND_F, Kind.RECV_B) else s - 1
        if not 0 <= other < self.num_stages:
            return None
        return self.location(other)[0]

    @cached_property
    def derived(self) -> dict[tuple, object]:
        """Facts that pure functions elsewhere compute from the actions (`simulate.in_flight`,
        `estimate/zero_pipeline.py`'s peak points), each kept once per schedule: a planner
        reads them for thousands of layouts sharing one schedule."""
        return {}

    def __str__(self) -> str:
        head = f"{self.name} p={self.p} m={self.m} v={self.v}"
        rows = [f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.ranks)]
        return "\n".join([head, *rows])


def comm_batches(actions: Sequence[Action]) -> list[range]:
    """Index ranges of an action list, each a compute action alone or a maximal run of
    consecutive communication actions: the batches a runtime posts together
    (batch_isend_irecv). Every schedule is validated deadlock-free posted this way."""
    batches: list[range] = []
    for j, a in enumerate(actions):
        if batches and a.is_comm and actions[j - 1].is_comm:
            batches[-1] = range(batches[-1].start, j + 1)
        else:
            batches.append(range(j, j + 1))
    return batches


@dataclass(frozen=True)
class TimedAction:
    """When one action ran on one rank: the record charts and traces are drawn from.

    The simulator produces these in its time unit; a runtime measuring real runs produces the
    same records in seconds.
    """

    rank: int
    index: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start
