"""Predicted step time of one layout: compute, pipeline bubble, communication, offload.

  step = makespan(pipeline of per-stage costs) + exposed dp traffic + offload traffic
         + optimizer + the step's small collectives

Per micro-batch and chunk (one pipeline stage's layers and ends), with R = peak·achievable
and o the fixed overhead of one pass of a block or the head (`pass_overhead_s`: kernel
launches, Python; calibrate measures it, it matters for small models only):
  F = forward FLOPs / tp / R + o·units + tp forward collectives + a
  B = F's compute + tp backward collectives + recompute (full: F's FLOPs, overhead and
      collectives again; selective: attention's q k^T and probs v again) + a
  W = F's compute (the weight gradients: backward = 2 x forward) (+ a where W is an action);
      under LoRA only the adapters' weight gradients, 2 FLOPs per adapter element per token
where a is the pipeline runtime's own time per action (`action_overhead_s`, calibrated:
posting and matching messages, Python; pipelines only).
The pipeline's simulator (`schedule/simulate.py`) runs the schedule under these
costs with each p2p message taking its alpha-beta time, so the bubble, uneven ends (the
head on the last stage) and p2p latency come out of one simulation; without a pipeline the
makespan is m·(F + B + W). Tensor-parallel collectives are synchronous in plait: they sit
inside F and B, never overlapped. The data-parallel gradient reduction is launched bucket by
bucket during the backward (stages 0-2), so up to `overlap` of it hides behind the last
micro-batch's backward (ZeRO-2/3: behind every backward; ZeRO-3's gathers are prefetched
behind the forward and backward too); ZeRO-1/2's parameter all-gather after the optimizer
step is exposed. Under a pipeline ZeRO-2/3 reduce once per step, behind the last backward as
ZeRO-1; ZeRO-3's gathers hide behind the first forward when the stage is kept gathered
through the step, behind every F and B when it is regathered (`--reshard-after-forward
always`; traffic: `estimate/zero_pipeline.py`). Offload moves the gradient shard to the host
and the updated parameters back (NVMe: the fp32 master and moments also from and to disk).
Activation offload copies each micro-batch's saved block tensors down in F and back in B at
`host_bandwidth` (`plan/activation_copies.py`: the copy down hides behind F's compute up to
`overlap`); the exposed part is in F and B, so the pipeline's simulation carries it, and is
reported in the offload term. The optimizer's own pass over the rank's shard (norm, clip,
AdamW, zero_grad) is memory-bound: shard elements x `optimizer_s_per_element` on the device;
offloaded, the host's reads and writes of master, moments and gradient at `host_bandwidth`,
no faster than that. The step's small collectives (loss, norm, tied embedding,
sequence-parallel partial gradients: `traffic.step_collectives`) are latencies on their
links. Not modelled: data loading.
Ranks that share cores (a CPU with fewer cores than ranks, `contention` > 1) speed up while
others wait in a pipeline bubble: the pipeline is simulated with its ranks sharing p / c
compute units (`plan/shared.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from plait.config import Config
from plait.estimate.model_facts import ModelFacts, facts_for
from plait.estimate.model_states import ADAM_STATES, ElementBytes
from plait.models.architecture import ModelConfig
from plait.models.transformer import head_forward_flops_per_token
from plait.plan.activation_copies import copy_seconds
from plait.plan.hardware import Hardware
from plait.plan.shared import shared_makespan
from plait.plan.traffic import (
    FP32,
    Links,
    dp_traffic,
    p2p_seconds,
    step_collective_seconds,
    tp_seconds,
)
from plait.schedule.actions import Schedule
from plait.schedule.schedules import build_schedule
from plait.schedule.simulate import Costs, simulate
from plait.schedule.stages import StagePlan

SHARED = ("flops", "recompute", "tp_f", "tp_b", "send_f", "send_b")
"""ChunkCost's parts that run faster alone where ranks share cores; the runtime's time per
action was measured by calibrate's probe with the cores mostly idle, and is taken as it is."""
EXACT_UP_TO = 3  # the in-flight peak of every schedule but gpipe is reached by 3p micro-batches
PERIOD = 2  # a steady pipeline repeats every 2p micro-batches (p when compute dominates p2p)


@dataclass
class Memo:
    """What a plan computes once and reuses across layouts: schedules per (name, p, m, v)
    (building them is the slow part), simulated makespans per costs, flat groups, and the
    model's facts by tp degree and pipeline cut (`estimate/model_facts.py`)."""

    built: dict[tuple[str, int, int, int], Schedule] = field(default_factory=dict)
    spans: dict[tuple, float] = field(default_factory=dict)
    groups: dict[tuple, list[tuple[int, int]]] = field(default_factory=dict)
    model_facts: ModelFacts | None = None

    def facts(self, model: ModelConfig) -> ModelFacts:
        """`model`'s facts, kept while the plan's layouts share that model."""
        self.model_facts = facts_for(model, self.model_facts)
        return self.model_facts

    def get(self, name: str, p: int, m: int, v: int) -> Schedule:
        key = (name, p, m, v)
        if key not in self.built:
            self.built[key] = build_schedule(name, p, m, v)
        return self.built[key]


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by term; `total` is the prediction."""

    compute: float  # the busiest rank's model FLOPs at the achievable rate
    recompute: float  # what recomputation adds to it
    tp: float  # the busiest rank's tensor-parallel collectives
    bubble: float  # pipeline idle time and p2p (makespan - compute - recompute - tp)
    dp: float  # exposed data-parallel / ZeRO traffic
    offload: float  # host (and disk) traffic: an offloaded optimizer's, activations' copies
    optimizer: float = 0.0  # the device optimizer's pass over the rank's shard
    sync: float = 0.0  # the step's small collectives: loss, norm, tied embedding, SP grads
    runtime: float = 0.0  # the pipeline runtime's own time per action (calibrated)

    @property
    def total(self) -> float:
        return sum(getattr(self, k) for k in TERMS)


TERMS = ("compute", "recompute", "runtime", "tp", "bubble", "dp", "offload", "optimizer", "sync")
"""StepTime's terms, in the order `plait plan` shows them."""


@dataclass(frozen=True)
class ChunkCost:
    """One micro-batch on one chunk, split by term (seconds)."""

    flops: float  # one pass (F, B or W) at the achievable rate, plus its fixed overhead
    recompute: float
    tp_f: float
    tp_b: float
    send_f: float = 0.0  # sending the activation on (where sends are not overlapped)
    send_b: float = 0.0  # sending the input gradient back
    action: float = 0.0  # the pipeline runtime's own time per compute action
    split: bool = False  # W is an action of its own (zb-h1), not part of B
    w_share: float = 1.0  # W's compute over F's: 1, or under LoRA the adapters' share
    copy_f: float = 0.0  # activation offload: the copy to the host that F does not hide
    copy_b: float = 0.0  # and the copy back, ahead of B's kernels

    @property
    def f(self) -> float:
        return self.flops + self.tp_f + self.send_f + self.action + self.copy_f

    @property
    def b(self) -> float:
        return self.flops + self.tp_b + self.recompute + self.send_b + self.action + self.copy_b

    @property
    def w(self) -> float:
        return self.flops * self.w_share + (self.action if self.split else 0.0)

    @property
    def actions(self) -> int:
        """Compute actions per micro-batch: F and B, and W where the backward is split."""
        return 3 if self.split else 2


def chunk_cost(
    cfg: Config, hw: Hardware, links: Links, plan: StagePlan, facts: ModelFacts | None = None
) -> ChunkCost:
    """One micro-batch's costs on `plan`'s chunk (module doc); `facts`: the model's, kept
    by a planner across layouts."""
    m, t, par = cfg.model, cfg.train, cfg.parallel
    tokens = t.micro_batch * t.seq_len
    facts = facts_for(m, facts)
    layer_flops = facts.layer_flops(t.seq_len)
    per_token = len(plan.layers) * layer_flops
    per_token += head_forward_flops_per_token(m) if plan.last else 0
    rate = hw.flop_rate * par.tp
    extra = 0.0
    if cfg.memory.recompute == "full":
        extra = tokens * len(plan.layers) * layer_flops / rate
    elif cfg.memory.recompute == "selective":
        extra = tokens * len(plan.layers) * 4 * t.seq_len * m.d_model / rate
    tp_f, tp_b = tp_seconds(cfg, links.tp, plan, cfg.memory.recompute == "full")
    overhead = hw.pass_overhead_s * (len(plan.layers) + (1 if plan.last else 0))
    if cfg.memory.recompute == "full":
        extra += hw.pass_overhead_s * len(plan.layers)
    action = hw.action_overhead_s if par.pp > 1 else 0.0
    flops = tokens * per_token / rate + overhead
    split = par.schedule == "zb-h1"
    copy_f, copy_b = copy_seconds(cfg, hw, plan, flops)
    return ChunkCost(flops, extra, tp_f, tp_b, action=action, split=split,
                     w_share=_weight_gradient_share(facts, len(plan.layers),
                                                    per_token),
                     copy_f=copy_f, copy_b=copy_b)  # fmt: skip


def _weight_gradient_share(facts: ModelFacts, layers: int, per_token: int) -> float:
    """W's FLOPs over F's: 1 when every weight trains (a weight gradient costs what its
    forward did); under LoRA only the adapters' (2 FLOPs per adapter element per token),
    the frozen base's weight gradients are never computed."""
    model = facts.model
    if model.lora is None or not per_token:
        return 1.0
    return 2 * layers * facts.total_parameters(True) / model.n_layers / per_token


def _sending(cost: ChunkCost, plan: StagePlan, busy: float) -> ChunkCost:
    """A stage's sends keep it busy for `busy` seconds each where communication does not
    overlap compute (gloo's sends run on the cores): F sends forward, B sends back."""
    if not busy:
        return cost
    f = 0.0 if plan.last else busy
    b = 0.0 if plan.first else busy
    return replace(cost, send_f=f, send_b=b)


def _all_plans(cfg: Config, facts: ModelFacts) -> list[list[StagePlan]]:
    par = cfg.parallel
    sizes = par.stage_layer_counts()
    return [facts.rank_plans(par.pp, par.virtual_stages, r, sizes) for r in range(par.pp)]


def makespan(
    cfg: Config,
    costs: list[ChunkCost],
    comm: float,
    memo: Memo,
    exact: bool = True,
    pool: float | None = None,
) -> float:
    """The pipeline's simulated makespan for m micro-batches; costs per global stage. Beyond
    6p micro-batches the steady state adds the same time every 2p micro-batches, so two
    shorter simulations, 2p apart and congruent to m, are extrapolated (tested against whole
    simulations). `pool`: the ranks share that many pipeline ranks' worth of compute
    (`plan/shared.py`); None: each owns its device.
    `exact=False`: a lower bound without simulating: the busiest rank's busy time (and the
    pool's share of all the work)."""
    par, m = cfg.parallel, cfg.accumulation
    if par.pp == 1:
        c = costs[0]
        return m * (c.f + c.b + c.w)
    name = "1f1b" if par.two_bw else par.schedule
    sim_costs = Costs([c.f for c in costs], [c.b for c in costs], [c.w for c in costs], comm)
    p, v = par.pp, par.virtual_stages

    def run(k: int) -> float:
        key = (name, p, k, v, tuple(sim_costs.f), tuple(sim_costs.b), tuple(sim_costs.w), comm)
        key += (pool,)
        if key not in memo.spans:
            sched = memo.get(name, p, k, v)
            span = simulate(sched, sim_costs).makespan if pool is None else None
            memo.spans[key] = float(span if span is not None else
                                    shared_makespan(sched, sim_costs, pool))  # fmt: skip
        return memo.spans[key]

    if par.two_bw or not exact:  # 2BW: no flush, each step's share of one fill and drain ~0
        work = [m * sum(c.f + c.b + c.w for c in costs[r::p]) for r in range(p)]
        return max(max(work), sum(work) / pool) if pool is not None else max(work)
    if m <= 3 * PERIOD * p:
        return run(m)
    lo = PERIOD * p + m % (PERIOD * p)  # m - lo is a whole number of periods
    t_lo, t_hi = run(lo), run(lo + PERIOD * p)
    return t_hi + (m - lo - PERIOD * p) // (PERIOD * p) * (t_hi - t_lo)


def step_time(
    cfg: Config, hw: Hardware, gpus_per_node: int, memo: Memo, simulate: bool = True
) -> StepTime:
    """The predicted seconds of one optimizer step of `cfg` (validated) on `hw`;
    `simulate=False` leaves the pipeline's bubble out (a lower bound, for pruning)."""
    par, m = cfg.parallel, cfg.accumulation
    links = Links.of(cfg, hw, gpus_per_node)
    facts = memo.facts(cfg.model)
    plans = _all_plans(cfg, facts)
    p2p = p2p_seconds(cfg, links.pp)
    shared = hw.contention > 1 and par.pp > 1
    # Ranks sharing cores: calibrate times a message while every rank computes, so the
    # sender's share of it is inside that delay, not extra busy time.
    send_busy = 0.0 if shared else (1 - hw.overlap) * p2p
    by_stage = {
        plan.stage: _sending(chunk_cost(cfg, hw, links, plan, facts), plan, send_busy)
        for ps in plans
        for plan in ps
    }
    costs = [by_stage[g] for g in range(par.pp * par.virtual_stages)]
    busy = [[by_stage[plan.stage] for plan in ps] for ps in plans]
    if shared:
        # The costs were measured with every rank busy; alone, a rank runs c times faster.
        # The message delay was measured under that load too and is taken as it is.
        k = 1 / hw.contention
        fast = [replace(c, **{f.name: getattr(c, f.name) * k for f in fields(c)
                              if f.name in SHARED}) for c in costs]  # fmt: skip
        span = makespan(cfg, fast, p2p, memo, simulate, pool=par.pp * k)
        counted = busy  # the pool does every rank's work: the terms are the ranks' mean
    else:
        span = makespan(cfg, costs, p2p, memo, simulate)
        counted = [max(busy, key=lambda cs: sum(c.f + c.b + c.w for c in cs))]
    compute = m * sum((2 + c.w_share) * c.flops for cs in counted for c in cs) / len(counted)
    recompute = m * sum(c.recompute for cs in counted for c in cs) / len(counted)
    tp = m * sum(c.tp_f + c.tp_b for cs in counted for c in cs) / len(counted)
    runtime = m * sum(c.action * c.actions for cs in counted for c in cs) / len(counted)
    copies = m * sum(c.copy_f + c.copy_b for cs in counted for c in cs) / len(counted)
    dp = off = opt = sync = 0.0
    for ps, cs in zip(plans, busy, strict=True):
        d, o, shard = _after_pipeline(cfg, hw, links, ps, cs, memo)
        dp, off = max(dp, d), max(off, o)
        opt = max(opt, _optimizer_seconds(cfg, hw, shard))
        sync = max(sync, step_collective_seconds(cfg, links, ps, facts))
    bubble = span - compute - recompute - tp - runtime - copies
    return StepTime(compute, recompute, tp, bubble, dp, off + copies, opt, sync, runtime)


def _after_pipeline(
    cfg: Config,
    hw: Hardware,
    links: Links,
    plans: list[StagePlan],
    costs: list[ChunkCost],
    memo: Memo,
) -> tuple[float, float, int]:
    """(exposed dp seconds, offload seconds, the optimizer's shard in elements) of one
    pipeline rank (module doc)."""
    par, m = cfg.parallel, cfg.accumulation
    traffic = dp_traffic(cfg, links.dp, plans, memo.groups, memo.facts(cfg.model))
    backward = sum(c.b + c.w for c in costs)  # one micro-batch's backward on this rank
    if par.pp > 1 and not par.two_bw and cfg.memory.zero >= 2:  # reduced once per step
        forward = sum(c.f for c in costs)
        exposed = traffic.reduce_s - hw.overlap * min(traffic.reduce_s, backward)
        if cfg.memory.zero == 2:  # the gathers follow the step
            exposed += traffic.gather_s
        else:  # prefetched behind the first forward (kept) or every F and B (regathered)
            again = cfg.memory.reshard_after_forward == "always"
            window = m * (forward + backward) if again else forward
            exposed += traffic.gather_s - hw.overlap * min(traffic.gather_s, window)
    elif cfg.memory.zero == 3:  # reduce-scatters and prefetched gathers run beside every F and B
        window = m * sum(c.f for c in costs) + m * backward
        overlappable = traffic.reduce_s + traffic.gather_s
        exposed = overlappable - hw.overlap * min(overlappable, window)
    else:  # the gradient buckets go out during the backward; the gathers follow the step
        window = backward * (m if cfg.memory.zero == 2 else 1)
        exposed = traffic.reduce_s - hw.overlap * min(traffic.reduce_s, window)
        exposed += traffic.gather_s
    return exposed, _offload_seconds(cfg, hw, traffic.shard), traffic.shard


def _offload_seconds(cfg: Config, hw: Hardware, shard: int) -> float:
    """The offload's traffic: the gradient shard down and the parameters up at
    `host_bandwidth`; NVMe also reads and writes the fp32 master and moments on disk."""
    if cfg.memory.offload == "none":
        return 0.0
    prec = ElementBytes.of_run(cfg)
    seconds = shard * (prec.reduce + prec.param) / hw.host_bandwidth
    if cfg.memory.offload == "nvme":
        seconds += 2 * (1 + ADAM_STATES) * FP32 * shard / hw.disk_bandwidth
    return seconds


def _optimizer_seconds(cfg: Config, hw: Hardware, shard: int) -> float:
    """The optimizer's pass over the rank's shard: on the device, `optimizer_s_per_element`
    each; offloaded, the host's Adam, which reads and writes the fp32 master and moments
    (and reads the gradient) in host memory, and is no faster than the device's measured
    pass (on a CPU the host is the device: the same pass, plus the offload's copies)."""
    device = shard * hw.optimizer_s_per_element
    if cfg.memory.offload == "none":
        return device
    host = (2 * (1 + ADAM_STATES) + 1) * FP32 * shard / hw.host_bandwidth
    return max(device, host)
