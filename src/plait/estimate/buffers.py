"""Communication buffers: what exists only while data moves, as units of the backward walk.

- ZeRO-2/3 gradient buckets: full-size reduction buffers in the reduction dtype, allocated
  when a bucket's first gradient arrives and freed once its reduce-scatter is done; at most
  `MAX_INFLIGHT_BUCKETS` in flight plus those filling (`zero/reducer.py`). Under ZeRO-3 the
  root's bucket fills from the head's gradients to the embedding's, the whole backward.
  Stages 0-1 keep their buckets as the gradients themselves, so they add nothing here.
- ZeRO-3 gathered units: the root unit (embedding, final norm, head) in the forward and the
  whole backward, the current block and the prefetched next one (`zero/flat_params.py`);
  a LoRA run trains nothing at the root (no root group), and gathers its frozen base's units
  beside the adapters' (`zero/frozen.py`).
- Under a pipeline, stages 2-3 reduce once per step and stage 3 keeps (or regathers) a
  stage's parameters: `estimate/zero_pipeline.py` gives what of them is alive when the
  activations peak and at their own peak (`pipeline_buffers`), two constants of the walk.
- Pipeline receive buffers: each received stage input lives until its backward (the
  schedule's in-flight count on non-first chunks), plus one received output gradient. The
  memory tracker does not see these (they are plain tensors of the runtime); they are part of
  the estimate, and of the allocator's peak on CUDA.

When each is alive is `estimate/peak.py`'s: this file says what the units are.
"""

from __future__ import annotations

from plait.config import Config
from plait.estimate.frozen_base import FrozenBase
from plait.estimate.lines import Line, Moment
from plait.estimate.model_states import ElementBytes, States, group_units
from plait.estimate.peak import BUFFERS, Unit, Walk, param_clock, units
from plait.estimate.rank_params import ParamSpec
from plait.estimate.zero_pipeline import pipeline_zero_buffers
from plait.schedule.actions import Schedule
from plait.schedule.simulate import peak_by_chunk
from plait.schedule.stages import StagePlan


def zero_units(
    cfg: Config,
    params: list[ParamSpec],
    labels: tuple[str, ...],
    groups: list[tuple[int, int]],
    prec: ElementBytes,
) -> dict[str, tuple[Unit, ...]]:
    """The gradient buckets (stages 2-3) and ZeRO-3's gathered units of this rank, as
    `Walk` fields; `groups`: (numel, padded) of its flat groups (`model_states`)."""
    par = cfg.parallel
    if cfg.memory.zero < 2 or not groups or _pipelined(cfg):
        return {}
    clock = param_clock(labels, params)
    members = group_units(params, cfg.memory.zero, par.bucket_mb)
    padded = [p for _, p in groups]
    out = {"buckets": units(members, padded, prec.reduce, clock)}
    if cfg.memory.zero == 3:
        out["gathered"] = units(members, padded, prec.param, clock)
    return out


def frozen_units(cfg: Config, base: FrozenBase | None, labels: tuple[str, ...]) -> tuple[Unit, ...]:
    """A LoRA base's units under ZeRO-3 (engine order: blocks last to first, then the
    root), at the positions of the blocks they belong to."""
    if base is None or base.stage != 3 or _pipelined(cfg):
        return ()
    blocks = [k for k, label in enumerate(labels) if label.startswith("block")]
    padded = [p * base.element for _, p in base.units]
    root = padded.pop() if base.has_root else None
    out = [Unit((k, 0), (k, 0), b) for k, b in zip(blocks, padded, strict=False)]
    end = (len(labels), 0)
    return tuple(out) + ((Unit((0, 0), end, root, True),) if root is not None else ())


def _pipelined(cfg: Config) -> bool:
    """A synchronous pipeline: its ZeRO-2/3 buffers are `pipeline_buffers`'."""
    return cfg.parallel.pp > 1 and not cfg.parallel.two_bw


def pipeline_buffers(
    cfg: Config,
    states: States,
    prec: ElementBytes,
    plans: list[StagePlan],
    schedule: Schedule | None,
    rank: int,
    base: FrozenBase | None = None,
) -> tuple[int, int]:
    """Under a synchronous pipeline, the ZeRO-2/3 buckets and gathered units (a frozen
    base's too) alive when the activations peak, and at their own peak
    (`zero_pipeline.py`); (0, 0) otherwise."""
    if schedule is None or not _pipelined(cfg):
        return 0, 0
    reshard = cfg.memory.reshard_after_forward
    trained = pipeline_zero_buffers(cfg.memory.zero, states, prec, plans, schedule, rank, reshard)
    at_peak, own = trained[2], trained[0] + trained[1]
    if base is not None:
        at_peak += base.gathered_at_activation_peak()
        own += base.gathered_peak()
    return at_peak, own


def receive_buffers(
    cfg: Config, plans: list[StagePlan], schedule: Schedule | None, rank: int, prec: ElementBytes
) -> int:
    """Received stage inputs held until their backward, plus one received gradient."""
    if schedule is None:
        return 0
    t, par = cfg.train, cfg.parallel
    seq = t.seq_len // (par.tp if par.sequence_parallel else 1)
    one = t.micro_batch * seq * cfg.model.d_model * prec.param
    inputs = peak_by_chunk(schedule, rank, [0 if plan.first else one for plan in plans])
    grads = one if not all(p.last for p in plans) else 0
    return int(inputs) + grads


def buffer_lines(walk: Walk, moments: tuple[Moment, ...]) -> list[Line]:
    """The 'comm_buffers' line (buckets and gathered units at their fullest moment) and the
    'pipeline_buffers' line (receive buffers, which the memory tracker does not register)."""
    fullest = max(moments, key=lambda m: sum(b for t, b in m.terms if t in BUFFERS))
    parts = [f"{t} {b:,} B" for t, b in fullest.terms if t in BUFFERS and b]
    comm = sum(b for t, b in fullest.terms if t in BUFFERS)
    why = f"{'; '.join(parts)} (at {fullest.name})" if comm else "none"
    recv = walk.receive
    recv_why = "stage inputs held until their backward + 1 gradient" if recv else "none"
    return [
        Line("comm_buffers", comm, formula=why),
        Line("pipeline_buffers", recv, formula=recv_why),
    ]
