"""The device total at the moment of the peak: what is alive then, moment by moment.

A rank's device memory is its model states, alive all the time, plus what comes and goes
within a step: saved activations, gradient buckets, ZeRO-3's gathered units, pipeline receive
buffers. These do not peak together (activations are largest when the forward ends, the
buckets and gathered units live in a backward that is freeing activations), so the total is
neither model states plus the sum of the peaks nor plus the larger one: it is model states
plus, at every moment of the step, the sum of what is alive then, and the largest of those.

The moments one micro-batch passes through on this rank:

- forward end: every activation the schedule holds at its peak (`Walk.held`), ZeRO-3's
  root unit still gathered (it is freed when the model's forward returns);
- backward at position k, k = 0, 1, ...: the head and loss (last stage), then each block,
  last first, then the embedding (first stage). At the moment position k's first gradient
  has arrived: the activations of positions before k are freed (`Walk.freed`), each bucket
  whose first gradient has arrived is allocated until it is reduced (launched strictly in
  group order, at most MAX_INFLIGHT_BUCKETS in flight: zero/reducer.py), ZeRO-3 holds the
  root for the whole backward and the unit at k and the prefetched one at k + 1
  (zero/flat_params.py), a frozen base its units at k and k + 1, the root only until the
  last block's backward starts (zero/frozen.py). The position's first nodes have freed what
  they saved by then (`Walk.early`: the loss's saves; a block's MLP down-projection input).

Each term is one function `term(walk, k) -> bytes` (k None: the forward end) in TERMS: a new
kind of memory that comes and goes (a buffer of a new feature) is one function and one
entry there, plus whatever `Walk` field it reads.

Within a block the walk looks at its first gradient only: the buckets its later gradients
open are assumed outweighed by the activations the block frees meanwhile (a block's saved
set is many times a bucket at the default 25 MB cap; at the benchmark's 0.25 MB it still
held within 2%). Under full recomputation the block recomputed in backward is not counted:
the memory tracker does not see it either (its tensors are torch.utils.checkpoint's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


def activations(w: Walk, k: int | None) -> int:
    return w.held - (0 if k is None else sum(w.freed[:k]) + w.early[k])


def buckets(w: Walk, k: int | None) -> int:
    """Allocated when its first gradient arrives, freed once reduced: the groups complete
    before k launch in order, and all but the last MAX_INFLIGHT_BUCKETS launched are done."""
    if k is None or not w.buckets:
        return 0
    now = (k, 0)  # position k's first gradient has arrived
    launched = 0
    while launched < len(w.buckets) and w.buckets[launched].last < now:
        launched += 1
    done = max(launched - MAX_INFLIGHT_BUCKETS, 0)
    return sum(u.nbytes for u in w.buckets[done:] if u.first <= now)


def gathered(w: Walk, k: int | None) -> int:
    """ZeRO-3's trainable units: the root all backward, the unit running and the next."""
    root = sum(u.nbytes for u in w.gathered if u.root)
    if k is None:
        return root
    return root + sum(u.nbytes for u in w.gathered if not u.root and u.first[0] in (k, k + 1))


def frozen(w: Walk, k: int | None) -> int:
    """A frozen base's units under ZeRO-3: freed when the next unit's backward starts."""
    root = sum(u.nbytes for u in w.frozen if u.root)
    if k is None:
        return root
    blocks = sum(u.nbytes for u in w.frozen if not u.root and u.first[0] in (k, k + 1))
    return blocks + (root if w.labels[k] == HEAD else 0)


def receive(w: Walk, k: int | None) -> int:
    return w.receive


TERMS: tuple[tuple[str, Callable[[Walk, int | None], int]], ...] = (
    ("activations", activations),
    ("buckets", buckets),
    ("gathered", gathered),
    ("frozen_gathered", frozen),
    ("receive_buffers", receive),
    ("pipeline_zero", pipeline_zero),
)
BUFFERS = ("buckets", "gathered", "frozen_gathered", "pipeline_zero")  # the comm_buffers line


def moments(w: Walk) -> tuple[Moment, ...]:
    """Every moment of the walk with what is alive then, term by term."""
    out = []
    for k in (None, *range(len(w.labels))):
        name = "forward end" if k is None else f"backward: {w.labels[k]}"
        out.append(Moment(name, tuple((t, f(w, k)) for t, f in TERMS)))
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
