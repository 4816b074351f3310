"""The device total at the moment of the peak: what is alive then, moment by moment.

A rank's device memory is its model states, alive all the time, plus what comes and goes
within a step: saved activations, gradient buckets, ZeRO-3's gathered units, pipeline receive
buffers. These do not peak together (activations are largest when the forward ends, the
buckets and gathered units live in a backward that is freeing activations), so the total is
neither model states plus the sum of the peaks nor plus the larger one: it is model states
plus, at every moment of the step, the sum of what is alive then, and the largest of those.

The moments one micro-batch passes through on this rank:

- forward, block i done: what the embedding and blocks 0..i have saved, ZeRO-3's root,
  block i (freed by its forward hook, just after) and the prefetched block i + 1 gathered
  (a frozen base's too: with small activations, under full recomputation, the peak of a
  LoRA run under ZeRO-3 is here);
- forward end: every activation the schedule holds at its peak (`Walk.held`), ZeRO-3's
  root unit still gathered (it is freed when the model's forward returns);
- backward at position k, k = 0, 1, ...: the head and loss (last stage), then each block,
  last first, then the embedding (first stage). At the moment position k's first gradient
  has arrived: the activations of positions before k are freed (`Walk.freed`), each bucket
  whose first gradient has arrived is allocated until it is reduced (launched strictly in
  group order, at most MAX_INFLIGHT_BUCKETS in flight: zero/reducer.py), ZeRO-3 holds the
  root for the whole backward and the unit at k and the prefetched one at k + 1
  (zero/flat_params.py), a frozen base its units at k and k + 1, the root only until the
  last block's backward starts (zero/frozen.py), and an NF4 base's largest weight
  dequantized for a product (models/nf4/linear.py). The
  position's first nodes have freed what they saved by then (`Walk.early`: the loss's
  saves; a block's MLP down-projection input).

Each term is one function `term(walk, at) -> bytes` (`At`: the phase and position) in
TERMS: a new kind of memory that comes and goes (a buffer of a new feature) is one function
and one entry there, plus whatever `Walk` field it reads.

Within a block the walk looks at its first gradient only: the buckets its later gradients
open are assumed outweighed by the activations the block frees meanwhile (a block's saved
set is many times a bucket at the default 25 MB cap; at the benchmark's 0.25 MB the totals
are still exact). Under full recomputation the block recomputed in backward is not counted:
the memory tracker does not see it either (its tensors are torch.utils.checkpoint's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import NamedTuple

from plait.estimate.lines import Moment
from plait.estimate.rank_params import ParamSpec
from plait.parallel.zero.layout import MAX_INFLIGHT_BUCKETS

HEAD, EMBEDDING = "head", "embedding"


@dataclass(frozen=True)
class Unit:
    """A flat group as the backward meets it: when its first and last gradient arrive, as
    (position, order within it), its full bytes (a bucket, or a gathered unit), and whether
    it is ZeRO-3's root unit (embedding, final norm, head)."""

    first: tuple[int, int]
    last: tuple[int, int]
    nbytes: int
    root: bool = False


@dataclass(frozen=True)
class Walk:
    """One rank's backward, position by position, and what each term needs to know."""

    labels: tuple[str, ...]  # the backward positions: "head", "block 3", ..., "embedding"
    held: int  # device activation bytes at the forward's end (the schedule's peak)
    freed: tuple[int, ...]  # device activation bytes each position frees
    early: tuple[int, ...]  # of which freed before its first gradient arrives
    buckets: tuple[Unit, ...] = ()  # ZeRO-2/3 gradient buckets, in launch order
    gathered: tuple[Unit, ...] = ()  # ZeRO-3's trainable units
    frozen: tuple[Unit, ...] = ()  # a LoRA base's units under ZeRO-3
    receive: int = 0  # pipeline receive buffers (alive through the step)
    pipeline_zero: tuple[int, int] = (0, 0)  # ZeRO-2/3 under a pipeline: at the peak, own
    dequantized: int = 0  # an NF4 base: the weight dequantized for one Linear's product

    @cached_property
    def freed_before(self) -> tuple[int, ...]:
        """`sum(freed[:k])` for every k: a moment reads it instead of summing again (a
        planner walks thousands of ranks of 80 blocks)."""
        return tuple(accumulate(self.freed, initial=0))

    @cached_property
    def gathered_at(self) -> dict[int | None, int]:
        """`by_position(gathered)`."""
        return by_position(self.gathered)

    @cached_property
    def frozen_at(self) -> dict[int | None, int]:
        """`by_position(frozen)`."""
        return by_position(self.frozen)


class At(NamedTuple):
    """A moment: `phase` "forward" (block at backward position k done), "end" (the
    forward's end, k None), "backward" (position k's first gradient has arrived) or
    "buffers" (a pipeline's ZeRO buffers at their own peak, k None)."""

    phase: str
    k: int | None = None


def activations(w: Walk, at: At) -> int:
    """Forward: what block k and the positions after it (in the backward's order) have saved
    once block k's forward is done; backward: all but what the positions before k have
    freed, and k's first nodes."""
    if at.phase in ("end", "buffers"):
        return w.held if at.phase == "end" else 0
    if at.phase == "forward":
        return w.held - w.freed_before[at.k]
    return w.held - w.freed_before[at.k] - w.early[at.k]


def buckets(w: Walk, at: At) -> int:
    """Allocated when its first gradient arrives, freed once reduced: the groups complete
    before k launch in order, and all but the last MAX_INFLIGHT_BUCKETS launched are done
    (none in the forward: each micro-batch's backward ends with all reduced)."""
    if at.phase != "backward" or not w.buckets:
        return 0
    now = (at.k, 0)  # position k's first gradient has arrived
    launched = 0
    while launched < len(w.buckets) and w.buckets[launched].last < now:
        launched += 1
    done = max(launched - MAX_INFLIGHT_BUCKETS, 0)
    return sum(u.nbytes for u in w.buckets[done:] if u.first <= now)


def by_position(units: tuple[Unit, ...]) -> dict[int | None, int]:
    """The bytes of the block units whose first gradient arrives at each position, and the
    roots' under None: `_running` reads two positions instead of summing every unit at every
    moment (a planner walks thousands of ranks of 80 blocks)."""
    out: dict[int | None, int] = {}
    for u in units:
        where = None if u.root else u.first[0]
        out[where] = out.get(where, 0) + u.nbytes
    return out


def _running(units: dict[int | None, int], at: At) -> int:
    """The block units gathered at `at`: the one running and the next one, prefetched (the
    next in the forward is the one before in the backward's order); `units`: `by_position`."""
    if at.k is None:
        return 0
    after = at.k - 1 if at.phase == "forward" else at.k + 1
    return units.get(at.k, 0) + units.get(after, 0)


def gathered(w: Walk, at: At) -> int:
    """ZeRO-3's trainable units: the root the whole forward and backward, the unit running
    and the next."""
    return w.gathered_at.get(None, 0) + _running(w.gathered_at, at)


def frozen(w: Walk, at: At) -> int:
    """A frozen base's units under ZeRO-3: as the trainable ones, but the root is freed when
    the last block's backward starts, each unit when the next one's does."""
    root = w.frozen_at.get(None, 0)
    if at.phase == "backward" and w.labels[at.k] != HEAD:
        root = 0
    return root + _running(w.frozen_at, at)


def receive(w: Walk, at: At) -> int:
    return w.receive


def pipeline_zero(w: Walk, at: At) -> int:
    """ZeRO-2/3 under a pipeline (`zero_pipeline.py`, which walks the schedule itself): what
    of its buckets and gathered units is alive when the activations peak, at the forward's
    end; at their own peak, the moment `moments` adds ("ZeRO buffers' peak")."""
    if at.phase == "end":
        return w.pipeline_zero[0]
    return w.pipeline_zero[1] if at.phase == "buffers" else 0


def dequantized(w: Walk, at: At) -> int:
    """An NF4 base's weight dequantized for a product, the largest one, as a block's
    backward starts (its MLP's down projection's input gradient is the first product). In
    the forward a product's weight is gone before the block's later saves are made (the
    adapters' inputs and what follows), which at least match it: not counted there."""
    if at.phase != "backward" or not w.labels[at.k].startswith("block"):
        return 0
    return w.dequantized


TERMS: tuple[tuple[str, Callable[[Walk, At], int]], ...] = (
    ("activations", activations),
    ("buckets", buckets),
    ("gathered", gathered),
    ("frozen_gathered", frozen),
    ("receive_buffers", receive),
    ("pipeline_zero", pipeline_zero),
    ("nf4_dequantized", dequantized),
)
BUFFERS = ("buckets", "gathered", "frozen_gathered", "pipeline_zero")  # the comm_buffers line


def moments(w: Walk) -> tuple[Moment, ...]:
    """Every moment of the walk with what is alive then, term by term: each block of the
    forward, the forward's end, each position of the backward."""
    blocks = [k for k, label in enumerate(w.labels) if label.startswith("block")]
    ats = [At("end")] + [At("forward", k) for k in reversed(blocks)]  # a tie: the end
    ats += [At("backward", k) for k in range(len(w.labels))]
    ats += [At("buffers")] if w.pipeline_zero[1] else []
    out = []
    for at in ats:
        name = {"end": "forward end", "buffers": "ZeRO buffers' peak"}.get(at.phase)
        name = name or f"{at.phase}: {w.labels[at.k]}"
        out.append(Moment(name, tuple((t, f(w, at)) for t, f in TERMS)))
    return tuple(out)


def positions(layers: tuple[int, ...], first: bool, last: bool) -> tuple[str, ...]:
    """The backward positions of a rank holding `layers` (its stages' blocks)."""
    blocks = tuple(f"block {i}" for i in sorted(layers, reverse=True))
    return ((HEAD,) if last else ()) + blocks + ((EMBEDDING,) if first else ())


def param_clock(labels: tuple[str, ...], params: list[ParamSpec]) -> Callable:
    """When each parameter's gradient arrives, as (position, order within it): the order is
    reverse registration (backward meets a block's last parameter first). The position is
    its block's, or for the root's parameters the head's (registered after a block: final
    norm, head) or the embedding's (before); a tied copy's comes last, after the walk."""
    index = {label: k for k, label in enumerate(labels)}
    seen, where = False, []
    for p in params:
        seen = seen or p.block is not None
        if p.isolated:
            where.append(len(labels))
        elif p.block is not None:
            where.append(index[f"block {p.block}"])
        else:
            side = HEAD if seen else EMBEDDING
            where.append(index.get(side, index.get(HEAD, len(labels) - 1)))
    clock, count = {}, [0] * (len(labels) + 1)
    for p, k in zip(reversed(params), reversed(where), strict=True):
        clock[p.name] = (k, count[k])
        count[k] += 1
    return lambda p: clock[p.name]


def units(
    groups: list[list[ParamSpec]], padded: list[int], elem: int, clock: Callable
) -> tuple[Unit, ...]:
    """Flat groups (`model_states.flat_units`) as units: when their first and last
    gradients arrive (`param_clock`), their full bytes (`padded` elements of `elem` bytes)."""
    out = []
    for group, p in zip(groups, padded, strict=True):
        times = [clock(x) for x in group]
        root = all(x.block is None for x in group)
        out.append(Unit(min(times), max(times), p * elem, root))
    return tuple(out)
