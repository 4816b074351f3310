"""The bytes plait's comm layer moves for a layout, per rank, with the time each takes.

Every figure comes from the formula the tests assert against `comm.py`'s counts
(`estimate/formulas.py`): tensor parallel per micro-batch (`tp_comm_per_microbatch`), the
data-parallel / ZeRO reductions per step (`zero_comm_elements`), and the pipeline's
point-to-point activations (b·s·h fp32, s/t under sequence parallelism:
`parallel/pipeline/driver.py`).
The link an axis uses follows plait's rank order (topology.py): tp fastest, then dp, then pp,
so a tp group spans tp consecutive ranks, a dp group tp·dp, a pp group the whole world.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.config import Config
from plait.estimate.formulas import tp_comm_per_microbatch, zero_comm_elements
from plait.estimate.frozen_base import FrozenBase, frozen_base
from plait.estimate.model_facts import ModelFacts, facts_for
from plait.estimate.model_states import ElementBytes, flat_groups, group_units
from plait.estimate.rank_params import rank_params, tp_contract
from plait.estimate.zero_pipeline import pipeline_zero_traffic
from plait.models.architecture import ModelConfig
from plait.models.block_table import block_table
from plait.plan.hardware import Hardware, Link
from plait.schedule.stages import StagePlan

FP32 = 4


@dataclass(frozen=True)
class Links:
    """The link class of each axis for one layout on nodes of `gpus_per_node`."""

    tp: Link
    dp: Link
    pp: Link

    @classmethod
    def of(cls, cfg: Config, hw: Hardware, gpus_per_node: int) -> Links:
        par = cfg.parallel
        return cls(
            hw.link(par.tp, gpus_per_node),
            hw.link(par.tp * par.dp, gpus_per_node),
            hw.link(par.tp * par.dp * par.pp, gpus_per_node),
        )


def tp_tables(cfg: Config, plan: StagePlan, recompute_full: bool) -> tuple[dict, dict]:
    """{(op, tag): (calls, elements)} of one micro-batch's tp collectives on one chunk,
    forward and backward (`formulas.tp_comm_per_microbatch`, then LoRA's changes). Full
    recomputation runs each block's forward again inside the backward, collectives included."""
    par, t = cfg.parallel, cfg.train
    bs = t.micro_batch * t.seq_len
    bsh, sp = bs * cfg.model.d_model, par.sequence_parallel
    fwd, bwd = tp_comm_per_microbatch(len(plan.layers), bsh, bs, sp, plan.first, plan.last)
    if recompute_full:
        for key, (calls, n) in tp_comm_per_microbatch(len(plan.layers), bsh, bs, sp)[0].items():
            if key[1] == "tp":
                bwd[key] = (bwd[key][0] + calls, bwd[key][1] + n)
    if cfg.model.lora is not None and plan.layers:
        _lora_tp(cfg, plan, fwd, bwd, bs, recompute_full)
    return fwd, bwd


def _lora_tp(cfg: Config, plan: StagePlan, fwd: dict, bwd: dict, bs: int, again: bool) -> None:
    """LoRA: each row-parallel target's A x rides in the base's collective, r more features
    per token (forward; backward too under SP, whose backward all-gathers it), and block 0's
    input needs no gradient, so its first column layer's backward reduction and the
    embedding's are skipped (exact when block 0's attention holds an adapter; fewer still
    are run when it holds none)."""
    sp, n = cfg.parallel.sequence_parallel, len(plan.layers)
    extra = bs * n * lora_row_features(cfg.model)
    out_op = "reduce_scatter" if sp else "all_reduce"
    key = (out_op, "tp")
    fwd[key] = (fwd[key][0], fwd[key][1] + extra)
    if again:  # the recomputed forward's row collectives
        bwd[key] = (bwd[key][0], bwd[key][1] + extra)
    if sp:  # the backward of a reduce-scatter all-gathers the same features
        back = ("all_gather", "tp")
        bwd[back] = (bwd[back][0], bwd[back][1] + extra)
    if plan.first:  # the frozen embedding's output needs no gradient (SP: no all-gather)
        bwd.pop(("all_gather", "tp-embed"), None)
    if plan.first and 0 in plan.layers:
        column = ("reduce_scatter" if sp else "all_reduce", "tp")
        bsh = bs * cfg.model.d_model
        bwd[column] = (bwd[column][0] - 1, bwd[column][1] - bsh)


def tp_seconds(
    cfg: Config, link: Link, plan: StagePlan, recompute_full: bool
) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's tp collectives on one chunk."""
    par = cfg.parallel
    if par.tp == 1:
        return 0.0, 0.0
    e = ElementBytes.of_run(cfg).param
    fwd, bwd = tp_tables(cfg, plan, recompute_full)

    def seconds(table: dict) -> float:
        total = 0.0
        for (op, tag), (calls, elements) in table.items():
            width = FP32 if tag == "tp-loss" else e
            total += link.time(op, par.tp, elements * width, calls)
        return total

    return seconds(fwd), seconds(bwd)


def lora_row_features(model: ModelConfig) -> int:
    """Features a layer's row-parallel LoRA targets add to their collectives per token: r
    each (A's partial product, summed with the base output in one all-reduce or
    reduce-scatter, and all-gathered back in the backward under SP)."""
    spec = model.lora
    if spec is None:
        return 0
    return spec.rank * sum(leaf in block_table(model).style("row") for leaf in spec.leaves)


def p2p_seconds(cfg: Config, link: Link) -> float:
    """One activation (or its gradient) crossing a pipeline boundary: fp32, (b, s/t?, h)."""
    par, t = cfg.parallel, cfg.train
    seq = t.seq_len // (par.tp if par.sequence_parallel else 1)
    return link.time("p2p", 2, t.micro_batch * seq * cfg.model.d_model * FP32)


@dataclass(frozen=True)
class DpTraffic:
    """One rank's data-parallel traffic per step: seconds of the gradient reduction (which
    the engine launches during backward, stages 0-2) and of the parameter gathers (a LoRA
    run's frozen base included under stage 3), the shard it owns (elements) for offload,
    and the bytes of the base it all-gathers (0 but under stage 3)."""

    reduce_s: float
    gather_s: float
    shard: int
    base_bytes: int = 0


def dp_traffic(
    cfg: Config,
    link: Link,
    plans: list[StagePlan],
    memo: dict | None = None,
    facts: ModelFacts | None = None,
) -> DpTraffic:
    """ZeRO's per-step traffic on one pipeline rank (`zero_comm_elements` on its padded
    flat groups, one call per group and per reduction), and under stage 3 a LoRA run's
    frozen base: each unit all-gathered twice per micro-batch at the base dtype, priced
    as the trainable gathers are (`estimate/frozen_base.py`); `memo` keeps the groups by cut
    and the traffic by everything it reads (layouts differing only in offload,
    recomputation or sequence parallelism share it); `facts`: the model's
    (`estimate/model_facts.py`)."""
    facts = facts_for(cfg.model, facts)
    if memo is None:
        return _dp_traffic(cfg, link, plans, {}, facts)
    par, mem, t, lora = cfg.parallel, cfg.memory, cfg.train, cfg.lora
    key = (par.tp, mem.zero, par.bucket_mb, par.dp, par.pp, par.two_bw, par.schedule,
           mem.reshard_after_forward, cfg.accumulation, t.precision, t.reduce_dtype,
           lora.base_upcast, lora.base_dtype, link.key, tuple((p.stage, p.layers) for p in plans),
           "traffic")  # fmt: skip
    if key not in memo:
        memo[key] = _dp_traffic(cfg, link, plans, memo, facts)
    return memo[key]


def _dp_traffic(
    cfg: Config, link: Link, plans: list[StagePlan], memo: dict, facts: ModelFacts
) -> DpTraffic:
    """`dp_traffic` priced, its groups kept in `memo` by cut, and a LoRA run's frozen base
    by what `frozen_base` reads besides (the base's element bytes, the pipeline's keeping)."""
    par, mem = cfg.parallel, cfg.memory
    prec = ElementBytes.of_run(cfg)
    key = (par.tp, mem.zero, par.bucket_mb, par.dp, cfg.lora.base_dtype, cfg.lora.base_upcast,
           tuple((p.stage, p.layers) for p in plans))  # fmt: skip
    if key not in memo:
        params = facts.rank_params(par.tp, plans)
        units = facts.group_units(par.tp, plans, mem.zero, par.bucket_mb)
        memo[key] = flat_groups(params, mem.zero, par.bucket_mb, par.dp, units)
        memo[(*key, "blocks")] = [frozenset(p.block for p in unit) for unit in units]
        memo[(*key, "padded")] = sum(p for _, p in memo[key])
    frozen = (*key, "frozen", prec.param, par.pp, par.two_bw, mem.reshard_after_forward)
    if cfg.model.lora is not None and frozen not in memo:
        memo[frozen] = frozen_base(facts.rank_params(par.tp, plans), cfg, prec)
    groups = memo[key]
    base = memo.get(frozen)
    padded = memo[(*key, "padded")]
    shard = padded if cfg.memory.zero == 0 else padded // par.dp
    if par.dp == 1:
        return DpTraffic(0.0, 0.0, shard)
    ops = _zero_ops(cfg, plans, groups, memo[(*key, "blocks")], padded)
    reduce_s = gather_s = 0.0
    for op, (n, calls) in ops.items():
        if op == "all_gather":
            gather_s += link.time(op, par.dp, n * prec.param, calls)
        else:
            reduce_s += link.time(op, par.dp, n * prec.reduce, calls)
    base_bytes = 0
    if base is not None and base.stage == 3:
        n, calls = _base_gathers(cfg, plans, base)
        base_bytes = n * base.element
        gather_s += link.time("all_gather", par.dp, base_bytes, calls)
    return DpTraffic(reduce_s, gather_s, shard, base_bytes)


def dp_elements(cfg: Config, plans: list[StagePlan]) -> dict[str, tuple[int, int]]:
    """{collective: (elements, calls)} of one rank's trainable groups over dp per step, as
    `dp_traffic` prices them (tests hold them to the comm layer's counts)."""
    par = cfg.parallel
    params = rank_params(tp_contract(cfg.model, par.tp), plans)
    units = group_units(params, cfg.memory.zero, par.bucket_mb)
    groups = flat_groups(params, cfg.memory.zero, par.bucket_mb, par.dp)
    return _zero_ops(cfg, plans, groups, [frozenset(p.block for p in unit) for unit in units])


def base_elements(cfg: Config, plans: list[StagePlan]) -> tuple[int, int]:
    """(elements, calls) a LoRA run's frozen base all-gathers per step under ZeRO-3."""
    par = cfg.parallel
    params = rank_params(tp_contract(cfg.model, par.tp), plans)
    prec = ElementBytes.of_run(cfg)
    return _base_gathers(cfg, plans, frozen_base(params, cfg, prec))


def _pipelined_zero(cfg: Config) -> bool:
    """ZeRO-2/3 under a synchronous pipeline: reduced once per step (estimate/zero_pipeline.py)."""
    par = cfg.parallel
    return par.pp > 1 and not par.two_bw and cfg.memory.zero >= 2


def _zero_ops(
    cfg: Config,
    plans: list[StagePlan],
    groups: list[tuple[int, int]],
    blocks: list,
    padded: int | None = None,
) -> dict[str, tuple[int, int]]:
    """{collective: (elements, calls)} of the trainable groups per step (`padded`: their
    padded elements, where the caller has them)."""
    par, k = cfg.parallel, cfg.accumulation
    if _pipelined_zero(cfg):
        split = par.schedule == "zb-h1"
        reshard = cfg.memory.reshard_after_forward
        return pipeline_zero_traffic(cfg.memory.zero, groups, blocks, plans, split, k, reshard)
    padded = sum(p for _, p in groups) if padded is None else padded
    per_step = {"all_reduce": 1, "reduce_scatter": k if cfg.memory.zero >= 2 else 1}
    per_step["all_gather"] = 2 * k if cfg.memory.zero == 3 else 1
    elements = zero_comm_elements(cfg.memory.zero, padded, k)
    return {op: (n, per_step[op] * len(groups)) for op, n in elements.items()}


def _base_gathers(cfg: Config, plans: list[StagePlan], base: FrozenBase) -> tuple[int, int]:
    """(elements, calls) a stage-3 LoRA base all-gathers per step."""
    par, k = cfg.parallel, cfg.accumulation
    groups, blocks = base.flat_groups()  # an NF4 block: its fp group and its packed bytes
    if not _pipelined_zero(cfg):
        return base.gathered_per_step(k), 2 * k * len(groups)
    split = par.schedule == "zb-h1"
    ops = pipeline_zero_traffic(3, groups, blocks, plans, split, k,
                                cfg.memory.reshard_after_forward)  # fmt: skip
    return ops["all_gather"]


def step_collectives(
    cfg: Config, plans: list[StagePlan], facts: ModelFacts | None = None
) -> dict[tuple[str, str], tuple[int, int, int]]:
    """The small per-step collectives of one rank outside the gradient reduction:
    {(axis, tag): (calls, elements, bytes per element)}, all all-reduces. Each one is a
    latency on a slow link (2(n-1) ring steps), whatever its size.

      loss         the step's loss averaged over dp (step.py) and summed over pp
                   (the pipeline runner: only the last stage holds it), fp32 scalars;
      grad_norm    the squared global norm summed over the axes its pieces are split on:
                   dp under ZeRO >= 1 (shards), tp, pp (parallel/grads.py), one float64;
      tied_embedding  a tied embedding's two copies summed over the pipeline's ends (not
                   under LoRA: the embedding is frozen);
      tp-sp-grads  under sequence parallelism the partial gradients (norms, row-parallel
                   biases, a learned position table) summed over tp, and LoRA's A beside a
                   column-parallel weight (at any tp; under LoRA only adapters count).

    Under ZeRO >= 1 a rank sums only the pieces in its shard; the elements are then the
    whole pieces' / dp (exact for the calls, the latency; near for the bytes). `facts`: the
    model's, kept by a planner across layouts (`estimate/model_facts.py`)."""
    par, m = cfg.parallel, cfg.model
    prec = ElementBytes.of_run(cfg)
    shard = par.dp if cfg.memory.zero >= 1 else 1
    out: dict[tuple[str, str], tuple[int, int, int]] = {}
    if par.dp > 1:
        out[("dp", "loss")] = (1, 1, FP32)
    if par.pp > 1:
        out[("pp", "loss")] = (1, 1, FP32)
    for axis, n in (("dp", par.dp if cfg.memory.zero >= 1 else 1), ("tp", par.tp), ("pp", par.pp)):
        if n > 1:
            out[(axis, "grad_norm")] = (1, 1, 8)
    first, last = any(p.first for p in plans), any(p.last for p in plans)
    if par.pp > 1 and m.tie_embeddings and m.lora is None and (first or last):
        table = -(-m.vocab_size // par.tp) * m.d_model  # the padded vocabulary's tp slice
        out[("pp_ends", "tied_embedding")] = (1, table // shard, prec.reduce)
    sp = par.sequence_parallel
    partial = facts_for(m, facts).tp_partial_elements(plans, sp) if par.tp > 1 else 0
    if partial:
        out[("tp", "tp-sp-grads")] = (1, partial // shard, prec.reduce)
    return out


def step_collective_seconds(
    cfg: Config, links: Links, plans: list[StagePlan], facts: ModelFacts | None = None
) -> float:
    """Seconds of `step_collectives` on their links (the ends of a pipeline pair: 2 ranks)."""
    par = cfg.parallel
    sizes = {"dp": (par.dp, links.dp), "tp": (par.tp, links.tp), "pp": (par.pp, links.pp)}
    sizes["pp_ends"] = (2, links.pp)
    total = 0.0
    for (axis, _), (calls, elements, width) in step_collectives(cfg, plans, facts).items():
        n, link = sizes[axis]
        total += link.time("all_reduce", n, elements * width, calls)
    return total
