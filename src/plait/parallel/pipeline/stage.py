"""Prune a model to this rank's pipeline stages (`schedule/stages.py` says which) and run a stage.

A rank keeps the *same* Transformer object, with the parts other ranks own replaced by an
`Absent` placeholder. Parameter names therefore stay the single-process names
("blocks.7.attn.wq.weight"), so layout-independent initialization, the data-parallel buckets
and the optimizer work unchanged. Stage 0 adds the embedding; the last stage adds the final
norm, the head and the loss. With tied embeddings the first and last stage each hold a copy
of the embedding matrix; both start from the same initial value (their canonical name is the
same) and their gradients are summed over the 'pp_ends' group (`parallel/grads.py`), so they
stay identical.

This file is the one place the pipeline runtime knows the model's parts (blocks, embed, norm,
head): pruning them, running a stage through them, and naming a stage's parameters.
"""

from __future__ import annotations

from torch import Tensor, nn

from plait.models.transformer import Transformer
from plait.schedule.stages import StagePlan


class Absent(nn.Module):
    """A part of the model that lives on another pipeline stage."""

    def forward(self, *args, **kwargs):  # pragma: no cover - reaching it is a bug
        raise RuntimeError("this part of the model lives on another pipeline stage")


def prune_to_stages(model: Transformer, plans: list[StagePlan]) -> None:
    """Replace every part of `model` that none of `plans` runs by Absent (on meta: free)."""
    keep = {i for plan in plans for i in plan.layers}
    for i in range(len(model.blocks)):
        if i not in keep:
            model.blocks[i] = Absent()
    if not any(plan.first for plan in plans):
        model.embed = Absent()
    if not any(plan.last for plan in plans):
        model.norm = Absent()
        model.head = Absent()


def run_stage(
    model: Transformer,
    plan: StagePlan,
    inp: Tensor,
    keys: Tensor | None,
    targets: Tensor | None = None,
) -> Tensor:
    """Forward of one stage: tokens or activations in; activations or the mean loss out."""
    x = model.embed(inp, keys) if plan.first else inp  # (b, s, h)
    for i in plan.layers:
        x = model.blocks[i](x, keys)  # (b, s, h)
    return model.output(x, targets) if plan.last else x


def stage_params(model: Transformer, plan: StagePlan) -> list[nn.Parameter]:
    """The parameters stage `plan` trains, each once (a tied matrix appears once): its
    blocks', the embedding's on the first stage, the final norm's and head's on the last.
    The split backward's W computes their gradients."""
    parts: list[nn.Module] = [model.blocks[i] for i in plan.layers]
    if plan.first:
        parts.append(model.embed)
    if plan.last:
        parts += [model.norm, model.head]
    seen: dict[int, nn.Parameter] = {}
    for part in parts:
        for p in part.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def stage_recomputed(model: Transformer, plan: StagePlan) -> bool:
    """Whether a block of the stage runs under full recomputation (`activation_recompute.py`
    marks it): the split backward then falls back to its plain form (`split_backward.py`)."""
    return any(getattr(model.blocks[i], "recomputed", False) for i in plan.layers)
