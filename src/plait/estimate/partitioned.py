"""Partitioned activations (`--partition-activations`): what they save and what they cost.

Each block's saved input (`activations.received_input_bytes`: the checkpoint under full
recomputation; under selective the first norm's input, where the norm saves the input itself:
LayerNorm, or RMSNorm in fp32) is held 1/t per tp rank instead of whole, and gathered once per
block per micro-batch in backward (parallel/partition_activations.py). A pipeline stage's
received input is a receive buffer the pipeline keeps, and is not partitioned. With symbols
as in activations.py, per partitioned block and micro-batch:

    held:      H·e  ->  H·e / t          (saving H·e·(1 - 1/t))
    gathered:  one all-gather of H·e     (logical bytes: the gathered tensor)

Zero-bubble's split backward (ZB-H1) unpacks a non-first stage's saved input twice, once in
B and once in W (the norm's node computes both gradients; under full recomputation W runs a
second backward), so those stages gather twice.
"""

from __future__ import annotations

from plait.config import Config
from plait.estimate import activations as act
from plait.estimate.model_states import ElementBytes
from plait.schedule.schedules import build_schedule
from plait.schedule.stages import StagePlan, rank_plans


def input_bytes(cfg: Config, x: act.MicroShape) -> int:
    """One block's saved input, whole; 0 when partitioning is off or has nothing to split."""
    par = cfg.parallel
    if not cfg.memory.partition_activations or x.t == 1 or par.sequence_parallel:
        return 0
    return act.received_input_bytes(cfg.model, x, cfg.memory.recompute)


def partitioned_blocks(cfg: Config, plan: StagePlan) -> int:
    """Blocks of one chunk whose saved input is partitioned (`is_partitioned`)."""
    return sum(is_partitioned(cfg, plan, i) for i in plan.layers)


def is_partitioned(cfg: Config, plan: StagePlan, layer: int) -> bool:
    """Whether block `layer` of the chunk has its saved input partitioned: all but a received
    input's (the pipeline keeps that buffer) and, under LoRA without full recomputation, block
    0's (fed by the frozen embedding, it needs no input gradient, so its frozen norm saves
    nothing)."""
    lora_first = cfg.model.lora is not None and cfg.memory.recompute != "full"
    skips_first = not plan.first or lora_first
    return not (skips_first and layer == plan.layers[0])


def block_saving(cfg: Config, x: act.MicroShape) -> int:
    """Bytes one partitioned block saves less for one micro-batch: (1 - 1/t) of its input."""
    whole = input_bytes(cfg, x)
    return whole - whole // x.t


def gathers_per_step(cfg: Config, pp_rank: int = 0) -> tuple[int, int]:
    """(calls, logical bytes) of the partitioning's all-gathers on one rank of pipeline
    rank `pp_rank` in one optimizer step: one per partitioned block per micro-batch."""
    par, t = cfg.parallel, cfg.train
    e = ElementBytes.of_run(cfg).param
    x = act.MicroShape(t.micro_batch, t.seq_len, par.tp, par.sequence_parallel, e)
    whole = input_bytes(cfg, x)
    if whole == 0:
        return 0, 0
    sizes = par.stage_layer_counts()
    plans = rank_plans(cfg.model.n_layers, par.pp, par.virtual_stages, pp_rank, sizes)
    m = cfg.accumulation
    split = (
        par.pp > 1 and build_schedule(par.schedule, par.pp, m, par.virtual_stages).split_backward
    )
    calls = m * sum(partitioned_blocks(cfg, p) * (2 if split and not p.first else 1) for p in plans)
    return calls, calls * whole
