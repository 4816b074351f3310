"""Communication buffers: what exists only while data moves.

- ZeRO-2/3 gradient buckets: full-size reduction buffers in the reduction dtype, allocated
  when a bucket's first gradient arrives and freed once its reduce-scatter is done; at most
  `MAX_INFLIGHT_BUCKETS` in flight plus the one filling (`zero/reducer.py`). Stages 0-1 keep
  their buckets as the gradients themselves, so they add nothing here.
- ZeRO-3 gathered layers: the root unit (embedding, final norm, head) stays gathered for the
  whole forward, with the current block and the prefetched next one (`zero/flat_params.py`);
  a LoRA run trains nothing at the root (no root group), and gathers its frozen base's units
  beside the adapters' (`estimate/frozen_base.py`).
- Under a pipeline, stages 2-3 reduce once per step and stage 3 keeps (or regathers) a
  stage's parameters: `estimate/zero_pipeline.py` (`rank_zero_buffers` picks).
- Pipeline receive buffers: each received stage input lives until its backward (the
  schedule's in-flight count on non-first chunks), plus one received output gradient. The
  memory tracker does not see these (they are plain tensors of the runtime); they are part of
  the estimate, and of the allocator's peak on CUDA.
"""

from __future__ import annotations

from plait.config import Config
from plait.estimate.frozen_base import FrozenBase
from plait.estimate.lines import Line
from plait.estimate.model_states import Precision, States
from plait.estimate.zero_pipeline import pipeline_zero_buffers
from plait.parallel.zero.layout import MAX_INFLIGHT_BUCKETS
from plait.schedule.actions import Schedule
from plait.schedule.simulate import peak_held
from plait.schedule.stages import StagePlan


def zero_buffers(
    stage: int, groups: list[tuple[int, int]], prec: Precision, root: bool = True
) -> tuple[int, int, int]:
    """(gradient bucket bytes, ZeRO-3 gathered bytes) at their own peaks, and what is
    alive when the activations peak (the backward's start: the gathered layers and the
    first bucket filling; stage 2 has launched no bucket yet). `root`: whether the last
    group is the root unit (not under LoRA, whose root trains nothing)."""
    padded = [p for _, p in groups]
    if stage < 2 or not padded:
        return 0, 0, 0
    largest = sorted(padded, reverse=True)
    buckets = sum(largest[: MAX_INFLIGHT_BUCKETS + 1]) * prec.reduce
    if stage < 3:
        return buckets, 0, 0
    root, blocks = (padded[-1], padded[:-1]) if root else (0, padded)
    blocks = sorted(blocks, reverse=True)
    gathered = (root + sum(blocks[:2])) * prec.param
    return buckets, gathered, gathered + largest[0] * prec.reduce


def rank_zero_buffers(
    cfg: Config,
    states: States,
    prec: Precision,
    plans: list[StagePlan],
    schedule: Schedule | None,
    rank: int,
    root: bool = True,
) -> tuple[int, int, int]:
    """`zero_buffers`, or under a synchronous pipeline `pipeline_zero_buffers`."""
    par = cfg.parallel
    if schedule is None or par.two_bw:
        return zero_buffers(par.zero, states.groups, prec, root)
    return pipeline_zero_buffers(
        par.zero, states, prec, plans, schedule, rank, par.reshard_after_forward
    )


def receive_buffers(
    cfg: Config, plans: list[StagePlan], schedule: Schedule | None, rank: int, prec: Precision
) -> int:
    """Received stage inputs held until their backward, plus one received gradient."""
    if schedule is None:
        return 0
    t, par = cfg.train, cfg.parallel
    seq = t.seq_len // (par.tp if par.sequence_parallel else 1)
    one = t.micro_batch * seq * cfg.model.d_model * prec.param
    inputs = peak_held(schedule.ranks[rank], lambda c: 0 if plans[c].first else one)
    grads = one if not all(p.last for p in plans) else 0
    return int(inputs) + grads


def buffer_lines(
    cfg: Config,
    states: States,
    plans: list[StagePlan],
    schedule: Schedule | None,
    rank: int,
    prec: Precision,
    base: FrozenBase | None = None,
) -> list[Line]:
    """The 'comm_buffers' line (what the memory tracker registers) and the
    'pipeline_buffers' line (receive buffers, which it does not); `base`: a LoRA run's
    frozen base, whose gathered units (stage 3) are buffers too."""
    buckets, gathered, _ = rank_zero_buffers(cfg, states, prec, plans, schedule, rank, base is None)
    once = schedule is not None and not cfg.parallel.two_bw  # reduced once per step
    keep = once and cfg.parallel.reshard_after_forward != "always"
    parts = []
    if buckets:
        what = "the stage's full gradient" if once else f"{MAX_INFLIGHT_BUCKETS + 1} largest"
        parts.append(f"{what} buckets {buckets:,} B")
    if gathered:
        what = "2 largest adapter blocks" if base else "root + 2 largest blocks"
        what = "the stage's groups" if keep else what
        parts.append(f"ZeRO-3 {what} gathered {gathered:,} B")
    frozen = base.gathered_peak() if base else 0
    if frozen:
        parts.append(f"frozen base root + 2 largest blocks gathered {frozen:,} B")
        gathered += frozen
    recv = receive_buffers(cfg, plans, schedule, rank, prec)
    why = "stage inputs held until their backward + 1 gradient" if recv else "none"
    return [
        Line("comm_buffers", buckets + gathered, formula="; ".join(parts) or "none"),
        Line("pipeline_buffers", recv, formula=why),
    ]
