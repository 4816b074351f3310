"""Split a model into pipeline stages: which layers each (rank, chunk) runs, and pruning.

A rank keeps the *same* Transformer object, with the parts other ranks own replaced by an
`Absent` placeholder. Parameter names therefore stay the single-process names
("blocks.7.attn.wq.weight"), so layout-independent initialization, the data-parallel buckets
and the optimizer work unchanged. Stage 0 adds the embedding; the last stage adds the final
norm, the head and the loss. With tied embeddings the first and last stage each hold a copy
of the embedding matrix; both start from the same initial value (their canonical name is the
same) and their gradients are summed over the 'pp_ends' group, so they stay identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from plait.errors import ConfigError
from plait.models.transformer import Transformer


class Absent(nn.Module):
    """A part of the model that lives on another pipeline stage."""

    def forward(self, *args, **kwargs):  # pragma: no cover - reaching it is a bug
        raise RuntimeError("this part of the model lives on another pipeline stage")


@dataclass(frozen=True)
class StagePlan:
    """What one global stage computes."""

    stage: int
    layers: range
    first: bool
    last: bool


def split_layers(n_layers: int, num_stages: int, sizes: Sequence[int] | None = None) -> list[range]:
    """Contiguous layer ranges per stage: `sizes` if given, else as even as possible.

    Even split: the remainder goes to the middle stages first, because stage 0 also runs
    the embedding and the last stage the head and loss.
    """
    if num_stages > n_layers:
        raise ConfigError(
            f"more pipeline stages (pp x virtual stages = {num_stages}) than layers ({n_layers})"
        )
    if sizes is None:
        base, extra = divmod(n_layers, num_stages)
        order = [*range(1, num_stages - 1), 0, num_stages - 1]
        bonus = set(order[:extra])
        sizes = [base + (1 if s in bonus else 0) for s in range(num_stages)]
    if len(sizes) != num_stages or sum(sizes) != n_layers or min(sizes) < 1:
        raise ConfigError(
            f"stage layer counts {list(sizes)} must be {num_stages} numbers >= 1 summing to "
            f"{n_layers} layers"
        )
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def rank_plans(
    n_layers: int, p: int, v: int, rank: int, sizes: Sequence[int] | None = None
) -> list[StagePlan]:
    """The v stages pipeline rank `rank` runs, chunk c being global stage c*p + rank."""
    ranges = split_layers(n_layers, p * v, sizes)
    last = p * v - 1
    return [
        StagePlan(c * p + rank, ranges[c * p + rank], c * p + rank == 0, c * p + rank == last)
        for c in range(v)
    ]


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


def tied_embedding_params(model: Transformer) -> list[nn.Parameter]:
    """The copies of a tied embedding this rank holds (one per pipeline end it owns)."""
    if not model.cfg.tie_embeddings:
        return []
    found = []
    if hasattr(model.embed, "tok"):
        found.append(model.embed.tok.weight)
    if hasattr(model.head, "weight") and all(model.head.weight is not p for p in found):
        found.append(model.head.weight)
    return found
