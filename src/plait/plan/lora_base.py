"""Under LoRA: keep the frozen base whole (ZeRO 0-2) or shard it (ZeRO-3), and why.

The base is almost all of a LoRA run's model states. ZeRO 0-2 hold it whole on every rank
and never move it; ZeRO-3 holds 1/N of it and all-gathers every unit before its forward and
again before its backward, 2 x micro-batches x the base per step (estimate/frozen_base.py).
The planner prices both (memory: `estimate`; time: `step_time`, whose dp term carries the
base's gathers, hidden behind compute as far as the profile's `overlap` lets them) and keeps
the base whole on a tie (search.BASE_TIE). This module sets the pick beside its twin (the
same layout with the base's other treatment) and says which was picked and why, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from plait.config import Config
from plait.estimate.table import gib
from plait.plan.enumerate import knobs
from plait.plan.search import Plan, Ranked, config_of, fits
from plait.plan.step_time import Memo, step_time
from plait.plan.traffic import Links, dp_traffic
from plait.schedule.stages import rank_plans


@dataclass(frozen=True)
class BaseSide:
    """One treatment of the base for the picked layout: ZeRO stage, the most loaded
    rank's device bytes and base bytes, whether it fits, its step time (None when it does
    not fit), the base bytes a rank all-gathers per step."""

    zero: int
    memory: int
    base: int
    fits: bool
    seconds: float | None
    gathered: int


def base_sides(out: Plan) -> tuple[BaseSide, BaseSide] | None:
    """(whole, sharded) for the plan's pick under LoRA over dp > 1, the pick's own side
    as ranked; None without LoRA, without dp or when the twin is not a valid layout."""
    if not out.ranked:
        return None
    pick = out.ranked[0]
    req, cand = out.request, pick.candidate
    if req.model.lora is None or cand.dp == 1:
        return None
    other = replace(cand, zero=2 if cand.zero == 3 else 3)
    if other not in knobs(req, cand):
        return None
    memo = Memo()
    mine = _side(out, pick.config, memo, pick)
    twin = _side(out, config_of(req, other), memo)
    return (twin, mine) if cand.zero == 3 else (mine, twin)


def _side(out: Plan, cfg: Config, memo: Memo, ranked: Ranked | None = None) -> BaseSide:
    ok, est = fits(cfg, out.budget, memo)
    worst = est.most_loaded
    seconds = None
    if ranked is not None:
        seconds = ranked.time.total
    elif ok:
        seconds = step_time(cfg, out.hardware, out.request.gpus_per_node, memo).total
    par = cfg.parallel
    link = Links.of(cfg, out.hardware, out.request.gpus_per_node).dp
    sizes = par.stage_layer_counts()
    gathered = max(
        dp_traffic(
            cfg, link, rank_plans(cfg.model.n_layers, par.pp, par.virtual_stages, r, sizes)
        ).base_bytes
        for r in range(par.pp)
    )
    return BaseSide(cfg.memory.zero, worst.total(), worst.frozen(), ok, seconds, gathered)


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if abs(s) < 1 else f"{s:,.2f} s"


def base_line(out: Plan) -> str | None:
    """The plan's one line on the LoRA base (module doc), or None where it does not apply."""
    sides = base_sides(out)
    if sides is None:
        return None
    whole, shard = sides
    picked = out.ranked[0].candidate.zero
    parts = []
    for side, how in ((whole, "holds it whole"), (shard, "shards it")):
        text = f"ZeRO-{side.zero} {how}, {gib(side.base)} of {gib(side.memory)} per GPU, "
        text += (
            f"all-gathers {side.gathered / 1e9:,.1f} GB of it per step"
            if side.gathered
            else ("no base traffic")
        )
        text += f", step {_ms(side.seconds)}" if side.seconds is not None else ", does not fit"
        parts.append(text)
    return f"LoRA base: {'; '.join(parts)}: picked ZeRO-{picked}: {_why(out, whole, shard)}."


def _why(out: Plan, whole: BaseSide, shard: BaseSide) -> str:
    mem = gib(out.memory)
    if out.headroom:
        mem = f"{gib(out.budget)} usable ({mem} less {gib(out.headroom)} of headroom)"
    if shard.zero == out.ranked[0].candidate.zero:
        if not whole.fits:
            return f"ZeRO-{whole.zero} needs {gib(whole.memory)}, more than the {mem} per GPU"
        assert whole.seconds is not None and shard.seconds is not None
        return f"predicted {_ms(whole.seconds - shard.seconds)} faster, its gathers hidden"
    if shard.seconds is None:  # cannot happen (less memory), but say so if it does
        return "ZeRO-3 does not fit either"
    assert whole.seconds is not None
    gap = shard.seconds - whole.seconds
    if gap > 0:
        return f"it fits and is {_ms(gap)} faster, moving no base"
    return "it fits and moves no base, at the same predicted time (within 1%)"
