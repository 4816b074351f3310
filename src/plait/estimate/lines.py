"""What an estimate is: lines (one per memory term, with its formula) per rank, per stage."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property

PLACES = ("device", "host", "disk")
LESSON_ORDER = (
    "parameters",
    "gradients",
    "master_weights",
    "optimizer_states",
    "activations",
    "comm_buffers",
    "pipeline_buffers",
)
FROZEN = "frozen_base"
"""A LoRA run's frozen base weights: a line of their own, after the adapters' states (the
four above count only what trains), present only under LoRA; the memory tracker does not
register them (they are the model's, not an engine's)."""


@dataclass(frozen=True)
class Line:
    """One term of a rank's memory: bytes by place and the formula that gives them."""

    name: str
    device: int
    host: int = 0
    disk: int = 0
    formula: str = ""

    def at(self, place: str) -> int:
        return getattr(self, place)


@dataclass(frozen=True)
class Moment:
    """One moment of a step (`estimate/peak.py`) and the bytes alive then beyond the model
    states, term by term."""

    name: str
    terms: tuple[tuple[str, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(b for _, b in self.terms)


@dataclass(frozen=True)
class RankEstimate:
    """The memory of one rank of pipeline stage `pp_rank` (any dp and tp coordinate)."""

    pp_rank: int
    layers: tuple[int, ...]
    parameters_held: int  # elements of this rank's parameters (its tp shard, its stages)
    in_flight: int  # (micro-batch, chunk) activations held at once, from the schedule
    lines: tuple[Line, ...]
    moments: tuple[Moment, ...] = ()  # what is alive beyond model states, moment by moment

    def line(self, name: str) -> Line:
        return next(x for x in self.lines if x.name == name)

    def frozen(self, place: str = "device") -> int:
        """The frozen base's bytes (0 without LoRA)."""
        return sum(x.at(place) for x in self.lines if x.name == FROZEN)

    def total(self, place: str = "device") -> int:
        """The peak of the sum, not the sum of the peaks: model states plus what is alive at
        the step's fullest moment (activations peak when the forward ends, the buckets and
        gathered units in a backward that is freeing activations: `estimate/peak.py`)."""
        if place != "device":
            return sum(x.at(place) for x in self.lines)
        return self.model_states() + self.peak_moment().nbytes

    def peak_moment(self) -> Moment:
        """The moment of the step at which the device holds the most."""
        return max(self.moments, key=lambda m: m.nbytes)

    def model_states(self, place: str = "device") -> int:
        """Parameters, gradients, masters and moments, and a LoRA run's frozen base."""
        return sum(self.line(n).at(place) for n in LESSON_ORDER[:4]) + self.frozen(place)


@dataclass(frozen=True)
class Estimate:
    """Per-stage estimates plus the single-GPU and ZeRO reference figures for this model."""

    psi: int
    ranks: tuple[RankEstimate, ...]
    reference: dict[str, float]

    @cached_property
    def most_loaded(self) -> RankEstimate:
        """The rank holding the most (a planner asks several times per layout)."""
        return max(self.ranks, key=lambda r: r.total())

    def to_dict(self) -> dict:
        out = asdict(self)
        for rank, r in zip(out["ranks"], self.ranks, strict=True):
            rank["total"] = {p: r.total(p) for p in PLACES}
            rank["peak_moment"] = r.peak_moment().name
        return out
