"""Which parameters a rank holds, counted from the config alone (no model is built).

The list is the model contract's (`models/declare.py`: the declarations a training rank's
model carries), split for one tp rank and held for one pipeline rank's stages, so "which
parameters a rank holds" has one home: registration order (embedding, blocks, final norm,
head), the shapes tensor parallelism gives each shard (column-parallel outputs and the
vocabulary split t ways, the vocabulary padded to a multiple of t, row-parallel biases and
norms replicated), the embedding on the first stage and the final norm and head on the last;
a tied embedding is one parameter when one rank holds both ends and a copy on each end
otherwise. The ZeRO engine's flat groups are formed from this list (`model_states.py`), so
padding and buckets come out as the engine makes them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from plait.models.architecture import ModelConfig
from plait.models.contract import ModelContract
from plait.models.declare import describe
from plait.schedule.stages import StagePlan


class ParamSpec(NamedTuple):
    """One parameter (or tp shard) on a rank: `block` is its transformer block, None for
    the embedding, final norm and head (ZeRO-3's root unit). A tuple: the planner makes
    one per parameter of every rank of thousands of layouts."""

    name: str
    numel: int
    block: int | None
    isolated: bool = False  # a tied embedding copy on a pipeline end: a flat group alone
    sp_partial: bool = False  # under sequence parallelism its gradient is summed over tp
    trainable: bool = True  # False: a LoRA run's frozen base (no group, gradient or state)


def padded_vocab(model: ModelConfig, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp (`tp/vocab.py`)."""
    return -(-model.vocab_size // tp) * tp


def tp_contract(model: ModelConfig, tp: int) -> ModelContract:
    """The contract of a tp rank's model before the pipeline split: tp rank 0's shards
    (every tp rank's local shapes are the same, padding included). Made once per layout and
    handed to `rank_params` for each of its pipeline ranks."""
    return describe(model).tensor_parallel(0, tp, sequence_parallel=False)


def rank_params(split: ModelContract, plans: list[StagePlan]) -> list[ParamSpec]:
    """Every parameter one (pp, tp) rank holds (`split`: `tp_contract`; `plans`: its
    stages), in registration order (unique: a tied embedding held at both ends by this rank
    is listed once)."""
    parts = (p for plan in plans for p in split.stage_parts(plan.layers, plan.first, plan.last))
    contract = split.holding(parts)
    numel: dict[int, int] = {}  # blocks share their declarations: one product each
    alone = contract.split_ties()
    out = []
    for name, part, d in contract.params():
        if id(d) not in numel:
            numel[id(d)] = math.prod(d.local_shape)
        out.append(
            ParamSpec(name, numel[id(d)], part.index, name in alone, d.sp_partial, d.trainable)
        )
    return out


def tp_partial_elements(model: ModelConfig, plans: list[StagePlan], sp: bool) -> int:
    """Elements of the trainable parameters of `plans`' parts whose gradient each tp rank
    holds only in part (replicated, so the same at any tp): under sequence parallelism those
    applied per position, and LoRA's A beside a column-parallel weight at any tp
    (parallel/grads.py `tp_partial_params`): what the 'tp-sp-grads' all-reduce sums."""
    whole = describe(model)
    sums: dict[int, int] = {}  # id(part.params) -> its partial elements (blocks share one)
    total = 0
    for plan in plans:
        for part in whole.stage_parts(plan.layers, plan.first, plan.last):
            if id(part.params) not in sums:
                sums[id(part.params)] = sum(
                    math.prod(d.shape)
                    for d in part.params
                    if d.trainable and (d.tp_partial or (sp and d.sp_partial))
                )
            total += sums[id(part.params)]
    return total


def total_parameters(model: ModelConfig, trainable: bool | None = None) -> int:
    """Ψ: the single-process model's unique parameters (`count_parameters` without torch),
    or only those that train (`trainable` True: under LoRA the adapters, Φ) or that do not
    (False: the frozen base). Blocks share one tuple of declarations, so each is counted
    once and multiplied (a planner calls this for thousands of layouts)."""
    contract = describe(model)
    sums: dict[int, int] = {}  # id(part.params) -> its elements (a tied copy: none)
    total = 0
    for part in contract.parts:
        if id(part.params) not in sums:
            sums[id(part.params)] = sum(
                math.prod(d.shape)
                for d in part.params
                if d.tied_to is None and trainable in (None, d.trainable)
            )
        total += sums[id(part.params)]
    return total
