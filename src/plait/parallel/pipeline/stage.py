"""Prune a model to this rank's pipeline stages (`schedule/stages.py` says which); run a stage.

A rank keeps the *same* Transformer object, with the parts other ranks own replaced by an
`Absent` placeholder; its contract (models/contract.py) then says which parts it holds.
Parameter names therefore stay the single-process names ("blocks.7.attn.wq.weight"), so
layout-independent initialization, the data-parallel buckets and the optimizer work
unchanged. Stage 0 adds the embedding; the last stage adds the final
norm, the head and the loss. With tied embeddings the first and last stage each hold a copy
of the embedding matrix; both start from the same initial value (their canonical name is the
same) and their gradients are summed over the 'pp_ends' group (`parallel/grads.py`), so they
stay identical.

This file is the one place the pipeline runtime knows the model's parts (blocks, embed, norm,
head): pruning them, running a stage through them, and naming a stage's parameters, all as
the model's contract lists them (`stage_parts`).
"""

from __future__ import annotations

from torch import Tensor, nn

from plait.models.contract import ModelContract, Part, contract_of
from plait.models.packing import Packing
from plait.models.transformer import Transformer
from plait.schedule.stages import StagePlan


class Absent(nn.Module):
    """A part of the model that lives on another pipeline stage."""

    def forward(self, *args, **kwargs):  # pragma: no cover - reaching it is a bug
        raise RuntimeError("this part of the model lives on another pipeline stage")


def prune_to_stages(model: Transformer, plans: list[StagePlan]) -> None:
    """Replace every part of `model` that none of `plans` runs by Absent (on meta: free);
    the model's contract then holds only the parts of `plans` (`stage_parts`)."""
    contract = model.contract
    kept = contract.holding(part for plan in plans for part in stage_parts(contract, plan))
    for part in contract.held_parts():
        if not kept.holds(part):
            model.set_submodule(part.path, Absent())
    model.set_contract(kept)


def stage_parts(contract: ModelContract, plan: StagePlan) -> tuple[Part, ...]:
    """The parts of the model that stage `plan` runs."""
    return contract.stage_parts(plan.layers, plan.first, plan.last)


def run_stage(
    model: Transformer,
    plan: StagePlan,
    inp: Tensor,
    keys: Tensor | None,
    targets: Tensor | None = None,
    segments: Tensor | None = None,
    denom: float | None = None,
) -> Tensor:
    """Forward of one stage: tokens or activations in; activations or the loss out (the sum
    of the targets' losses / `denom`, models/loss.py). `segments`: packed rows; every stage
    draws the same micro-batch, so each builds their positions and mask itself, once per
    call, and nothing about them travels between stages."""
    pack = Packing.of(segments, model.packed_attention)
    x = model.embed(inp, keys, pack=pack) if plan.first else inp  # (b, s, h)
    for i in plan.layers:
        x = model.blocks[i](x, keys, None, pack)  # (b, s, h)
    return model.output(x, targets, denom) if plan.last else x


def stage_params(model: Transformer, plan: StagePlan) -> list[nn.Parameter]:
    """The parameters stage `plan` trains, each once (a tied matrix appears once), as the
    contract declares them: the embedding's on the first stage, its blocks', the final norm's
    and head's on the last; frozen ones left out. The split backward's W computes their
    gradients."""
    contract = contract_of(model)
    parts = stage_parts(contract, plan)
    return [p for e, p in contract.bind(model, parts) if e.decl.trainable]


def stage_recomputed(model: Transformer, plan: StagePlan) -> bool:
    """Whether a block of the stage runs under full recomputation (the contract records it:
    `activation_recompute.py`): the split backward then falls back to its plain form
    (`split_backward.py`)."""
    return bool(contract_of(model).recomputed & set(plan.layers))
