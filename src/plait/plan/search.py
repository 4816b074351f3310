"""The planner: enumerate layouts, drop those that do not fit, rank the rest by step time.

1. Every shape (enumerate.py) is tried first with its most frugal knobs (ZeRO highest,
   offloaded, full recompute, sequence parallel): if even that does not fit on the device,
   no setting of the shape does, and the shape is dropped with the estimator's reason.
2. The remaining layouts are sorted by a lower bound of their step time (the busiest rank's
   compute and collectives, no bubble), then walked in that order: each is checked against
   the memory (`estimate` plus the headroom that plan/headroom.py keeps free) and, if it
   fits, timed exactly (`step_time`, which simulates the pipeline). The walk stops once
   `top` layouts fit and the next bound is slower than the slowest of them, so the
   simulator runs for a few dozen layouts, not thousands. Activation offload (the same
   time or more, less device memory) is a setting's last resort: its twin offloading
   activations joins the walk at its own bound only once the setting does not fit.
Per shape, only its fastest fitting knobs are ranked (slower settings of the same cut only
save memory the winner does not need). Under LoRA, a ZeRO-3 setting gathers the whole frozen
base every micro-batch; it goes after the cut's settings that keep the base whole unless
its bound is more than `BASE_TIE` lower (plan/lora_base.py says which was picked and why).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace

from plait.config import Config, build_config
from plait.estimate import Estimate, estimate
from plait.estimate.rank_params import total_parameters
from plait.models.transformer import matmul_flops_per_token
from plait.plan.activation_copies import host_fits, most_host_per_node
from plait.plan.enumerate import FRUGAL, Candidate, Request, knobs, most_frugal, shapes
from plait.plan.hardware import Hardware
from plait.plan.step_time import EXACT_UP_TO, Memo, StepTime, step_time

BASE_TIE = 0.01
"""Under LoRA, predicted times within 1% are a tie between keeping the frozen base whole
(ZeRO 0-2: no base traffic) and sharding it (ZeRO-3: 2 x micro-batches x the base all-gathered
per step), and a tie goes to the setting that moves no base: the other's time rests on the
profile's `overlap` hiding gigabytes of gathers per step."""


def moves_base(cfg: Config) -> bool:
    """Whether `cfg` all-gathers a LoRA run's frozen base (ZeRO-3 over dp > 1)."""
    par = cfg.parallel
    return cfg.model.lora is not None and cfg.memory.zero == 3 and par.dp > 1


@dataclass(frozen=True)
class Ranked:
    """A layout that fits, with its predicted memory and time."""

    candidate: Candidate
    config: Config
    time: StepTime
    memory: int  # device bytes of the most loaded rank

    def tokens_per_s(self) -> float:
        t = self.config.train
        return t.global_batch * t.seq_len / self.time.total

    def mfu(self, hw: Hardware, gpus: int) -> float:
        """Model FLOPs per second over the peak. Under LoRA the frozen base's weight
        gradients are never computed: forward and input gradients (2/3 of 6N + attention)
        plus the adapters' 6 FLOPs per element per token."""
        m = self.config.model
        flops = matmul_flops_per_token(m, self.config.train.seq_len)
        if m.lora is not None:
            flops = flops * 2 / 3 + 6 * total_parameters(m, trainable=True)
        return self.tokens_per_s() * flops / (hw.peak_flops * gpus)


@dataclass(frozen=True)
class Dropped:
    """A layout that does not fit: what it needs and its largest term."""

    candidate: Candidate
    need: int
    largest: str
    largest_bytes: int


@dataclass
class Plan:
    """What the planner found."""

    request: Request
    hardware: Hardware
    memory: int
    headroom: int = 0  # bytes each device keeps free (plan/headroom.py)
    ranked: list[Ranked] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)  # cheapest-need first
    considered: int = 0

    @property
    def budget(self) -> int:
        """The bytes a layout's estimate may take: the device's memory less the headroom."""
        return self.memory - self.headroom


def config_of(req: Request, cand: Candidate) -> Config:
    cfg = build_config(req.preset, cand.overrides(req))
    cfg.model = req.model
    return cfg


def memory_schedule(cfg: Config, memo: Memo):
    """The schedule whose in-flight peak the estimator counts: the real one, or one of 3p
    micro-batches (the same peak for every schedule but gpipe, which is built whole)."""
    par, m = cfg.parallel, cfg.accumulation
    if par.pp == 1:
        return None
    name = "1f1b" if par.two_bw else par.schedule
    k = m if name == "gpipe" or m <= EXACT_UP_TO * par.pp else EXACT_UP_TO * par.pp
    return memo.get(name, par.pp, k, par.virtual_stages)


def fits(cfg: Config, memory: int, memo: Memo) -> tuple[bool, Estimate]:
    est = estimate(cfg, memory_schedule(cfg, memo), memo.facts(cfg.model))
    return est.most_loaded.total() <= memory, est


def _dropped(cand: Candidate, est: Estimate) -> Dropped:
    worst = est.most_loaded
    big = max(worst.lines, key=lambda line: line.device)
    return Dropped(cand, worst.total(), big.name, big.device)


def _fits_plan(out: Plan, cand: Candidate, cfg: Config, memo: Memo) -> tuple[bool, Estimate]:
    """`fits` on the device, then the host of every node where the profile bounds it; a
    layout the host cannot hold is dropped naming the busiest node's host bytes."""
    ok, est = fits(cfg, out.budget, memo)
    if not ok:
        out.dropped.append(_dropped(cand, est))
        return False, est
    if not host_fits(est, cfg, out.hardware, out.request.gpus_per_node):
        host = most_host_per_node(est, cfg, out.request.gpus_per_node)
        out.dropped.append(Dropped(cand, est.most_loaded.total(), "host per node", host))
        return False, est
    return True, est


def plan(req: Request, hw: Hardware, memory: int, top: int = 8, headroom: int = 0) -> Plan:
    """Rank the layouts of `req` on `hw` devices of `memory` bytes, of which a layout must
    leave `headroom` unused (module doc)."""
    out, memo = Plan(req, hw, memory, headroom), Memo()
    pool: list[tuple[float, int, Candidate, Config]] = []
    for shape in shapes(req):
        options = knobs(req, shape, not hw.host_is_device)
        out.considered += len(options)
        frugal = most_frugal(options)
        ok, _ = _fits_plan(out, frugal, config_of(req, frugal), memo)
        if not ok:
            continue
        for cand in (c for c in options if c.offload_activations == "none"):
            bound, c = _bound(out, cand, memo)
            pool.append((bound, len(pool), cand, c))
    _walk(out, pool, top, memo)
    out.dropped.sort(key=lambda d: d.need)
    return out


def _bound(out: Plan, cand: Candidate, memo: Memo) -> tuple[float, Config]:
    """`busy_bound` of a candidate (raised by `BASE_TIE` where it gathers a LoRA base), and
    its config."""
    c = config_of(out.request, cand)
    bound = busy_bound(c, out.hardware, out.request.gpus_per_node, memo)
    return (bound * (1 + BASE_TIE) if moves_base(c) else bound), c


def busy_bound(cfg: Config, hw: Hardware, gpus_per_node: int, memo: Memo) -> float:
    """A lower bound of the step time: everything but the bubble."""
    t = step_time(cfg, hw, gpus_per_node, memo, simulate=False)
    return t.total - t.bubble


def needs_less(a: Candidate, b: Candidate) -> bool:
    """Whether `a`'s knobs save at least as much memory as `b`'s on every axis."""
    return (
        a.zero >= b.zero
        and FRUGAL[a.offload] >= FRUGAL[b.offload]
        and FRUGAL[a.recompute] >= FRUGAL[b.recompute]
        and a.sequence_parallel >= b.sequence_parallel
        and FRUGAL[a.offload_activations] >= FRUGAL[b.offload_activations]
        and FRUGAL[a.reshard] >= FRUGAL[b.reshard]
    )


def _walk(out: Plan, pool: list, top: int, memo: Memo) -> None:
    """Time the candidates in the order of their bounds (module doc). Activation offload is
    a setting's last resort: its twin offloading activations (the same time or more, less
    device memory) joins the walk, at its own bound, only when the setting does not fit on
    the device, so its bound is computed for a few settings, not all."""
    req, hw = out.request, out.hardware
    best: dict[tuple, Ranked] = {}
    failed: dict[tuple, list[Candidate]] = {}
    heapq.heapify(pool)  # (bound, order of enumeration, candidate, config)
    joined = len(pool)

    def offload_instead(cand: Candidate) -> None:
        """The setting did not fit (or one saving more memory did not): its twin with the
        activations offloaded joins the walk at its own bound."""
        nonlocal joined
        if cand.offload_activations == "none" and not hw.host_is_device:
            twin = replace(cand, offload_activations="cpu")
            twin_bound, twin_cfg = _bound(out, twin, memo)
            heapq.heappush(pool, (twin_bound, joined, twin, twin_cfg))
            joined += 1

    while pool:
        bound, _, cand, cfg = heapq.heappop(pool)
        slowest = sorted(r.time.total for r in best.values())[top - 1 : top]
        if slowest and bound > slowest[0]:
            break
        if cand.shape in best:
            continue  # its first fitting setting by bound: the rest differ by little time
        if any(needs_less(f, cand) for f in failed.get(cand.shape, [])):
            offload_instead(cand)  # a setting of this cut saving more memory did not fit
            continue
        ok, est = _fits_plan(out, cand, cfg, memo)
        if not ok:
            failed.setdefault(cand.shape, []).append(cand)
            offload_instead(cand)
            continue
        t = step_time(cfg, hw, req.gpus_per_node, memo)
        best[cand.shape] = Ranked(cand, cfg, t, est.most_loaded.total())
    out.ranked = sorted(best.values(), key=rank_key)


def rank_key(r: Ranked) -> tuple[float, int]:
    """Faster first (a layout gathering a LoRA base by more than `BASE_TIE`), then leaner."""
    return (r.time.total * (1 + BASE_TIE) if moves_base(r.config) else r.time.total, r.memory)
