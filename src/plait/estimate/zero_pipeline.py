"""ZeRO-2/3 under a pipeline: the buffers of a stage that reduces once per step.

Without a pipeline, stages 2-3 reduce-scatter after every micro-batch, so at most a few
gradient buckets and two blocks are alive at once (`buffers.zero_buffers`). Under a
pipeline (`zero/reducer.py`, `zero/pipeline_gather.py`) the stage keeps, on top of its
model states (the same shards as without one):

- its full gradient, one bucket per flat group in the reduction dtype, from the group's
  first gradient of the step until its reduce-scatter after the chunk's last backward:
  sum(P)·r, the gradient ZeRO-2 saves everywhere but during accumulation;
- stage 3, kept through the step (`--reshard-after-forward default|never`): every group
  gathered, sum(P)·p, the stage's whole parameters in the compute dtype;
- stage 3, regathered (`always`): the ends (embedding, final norm, head, kept through the
  step) and the two largest blocks of a chunk (one computing, one prefetched: prefetching
  stops at the chunk's edge); under zb-h1 W gathers a whole chunk's blocks at once.

What is alive when the activations peak: the gathered parameters always, and the gradient
buckets of the chunks whose backward has begun (and not ended) when the schedule reaches
its most activations in flight again after the rank's first backward (1F1B, interleaved,
zb-h1: the steady state); where every forward comes first (GPipe, naive) only the first
bucket to fill, in the backward that starts to free them (the largest is counted).
"""

from __future__ import annotations

from plait.estimate.model_states import ElementBytes, States
from plait.schedule.actions import Kind, Schedule
from plait.schedule.simulate import peak_held
from plait.schedule.stages import StagePlan


def pipeline_zero_buffers(
    stage: int,
    states: States,
    prec: ElementBytes,
    plans: list[StagePlan],
    schedule: Schedule,
    rank: int,
    reshard: str = "default",
) -> tuple[int, int, int]:
    """(gradient bucket bytes, ZeRO-3 gathered bytes) at their peaks, and what of them is
    alive when the activations peak, for pipeline rank `rank` running `plans`."""
    padded = [p for _, p in states.groups]
    if stage < 2 or not padded:
        return 0, 0, 0
    buckets = sum(padded) * prec.reduce
    chunks = _group_chunks(states.blocks, plans)
    # A peak before any gradient still meets the first bucket filling, in the backward
    # that begins to free the activations (counted as the largest, as without a pipeline).
    alive = max(_buckets_at_peak(schedule, rank, chunks, padded), max(padded))
    at_peak = alive * prec.reduce
    if stage < 3:
        return buckets, 0, at_peak
    layers = sorted((i for plan in plans for i in plan.layers), reverse=True)  # group order
    blocks, ends = padded[: len(layers)], padded[len(layers) :]
    if reshard != "always":
        gathered = sum(padded) * prec.param
        return buckets, gathered, at_peak + gathered
    per_chunk: list[list[int]] = [[] for _ in plans]
    for group_chunks, size in zip(chunks, blocks, strict=False):
        per_chunk[min(group_chunks)].append(size)  # a block is one chunk's
    # One block computing and the next prefetched, within a chunk; W gathers a whole chunk.
    top = len(blocks) if schedule.split_backward else 2
    held = max(sum(sorted(sizes, reverse=True)[:top]) for sizes in per_chunk)
    gathered = (sum(ends) + held) * prec.param
    return buckets, gathered, at_peak + gathered


def _group_chunks(blocks: list[frozenset], plans: list[StagePlan]) -> list[frozenset[int]]:
    """The chunks whose gradients fill each group (the ends: the first or last chunk)."""
    chunk_of: dict[int | None, int] = {i: c for c, plan in enumerate(plans) for i in plan.layers}
    ends = [c for c, plan in enumerate(plans) if plan.first or plan.last]
    chunk_of[None] = ends[0] if ends else 0
    return [frozenset(chunk_of[b] for b in group) for group in blocks]


def _buckets_at_peak(
    schedule: Schedule, rank: int, chunks: list[frozenset[int]], padded: list[int]
) -> int:
    """Most bucket elements alive at a point where rank `rank` holds its most activations
    in flight: a group's bucket lives from the first gradient action (B, or W under a split
    backward) of any of its chunks to the last micro-batch's of all of them."""
    best = 0
    for started, finished in _peak_points(schedule, rank):
        alive = sum(
            size
            for cs, size in zip(chunks, padded, strict=True)
            if cs & started and not cs <= finished
        )
        best = max(best, alive)
    return best


def _peak_points(schedule: Schedule, rank: int) -> tuple[tuple[frozenset, frozenset], ...]:
    """(chunks whose gradients have begun, chunks whose last micro-batch's gradient is done)
    at each F where rank `rank` holds its most activations in flight: walked once per
    schedule (`Schedule.derived`), weighed by each layout's groups."""
    key = ("zero_peak_points", rank)
    if key in schedule.derived:
        return schedule.derived[key]  # type: ignore[return-value]
    actions = schedule.ranks[rank]
    done = Kind.W if schedule.split_backward else Kind.B
    peak = peak_held(actions, until_w=schedule.split_backward)
    started: set[int] = set()
    finished: set[int] = set()
    held = 0
    points: dict[tuple[frozenset, frozenset], None] = {}
    for a in actions:
        if a.kind is Kind.F:
            held += 1
        elif a.kind is done:
            held -= 1
            started.add(a.chunk)
            if a.microbatch == schedule.m - 1:
                finished.add(a.chunk)
        if a.kind is Kind.F and held == peak:
            points[(frozenset(started), frozenset(finished))] = None
    schedule.derived[key] = tuple(points)
    return schedule.derived[key]  # type: ignore[return-value]


def pipeline_zero_traffic(
    stage: int,
    groups: list[tuple[int, int]],
    blocks: list[frozenset[int | None]],
    plans: list[StagePlan],
    split_backward: bool,
    microbatches: int,
    reshard: str = "default",
) -> dict[str, tuple[int, int]]:
    """{collective: (elements, calls)} over dp per step of ZeRO-2/3 on a pipeline rank
    (`groups`, each group's `blocks`; also a LoRA base's units under stage 3):

      reduce-scatter  every group once, after its chunk's last backward (stages 2-3);
      all-gather      stage 2: every group once, after the update; stage 3 kept
                      through the step: every group once; regathered: the ends once, each
                      block once per forward and per gradient pass of each micro-batch
                      (B; and W under zb-h1, except on the first stage, whose B is empty).
    """
    padded = [p for _, p in groups]
    out = {"reduce_scatter": (sum(padded), len(padded))} if stage >= 2 else {}
    if stage < 3 or reshard != "always":
        return out | {"all_gather": (sum(padded), len(padded))}
    chunks = _group_chunks(blocks, plans)
    elements = calls = 0
    for group, size, cs in zip(blocks, padded, chunks, strict=True):
        if None in group:  # an end: kept through the step
            times = 1
        else:
            first = plans[min(cs)].first
            times = microbatches * (2 + (split_backward and not first))
        elements += size * times
        calls += times
    return out | {"all_gather": (elements, calls)}
