"""`apply_tensor_parallel`: turn a model from models/transformer.py into its tp-sharded form.

The model's code is unchanged. A declarative plan (module path -> style) says what happens
to each submodule of a block; the model level (embedding, head, loss) is handled by
`_apply_model_level`. Module paths and parameter names stay those of the single-process
model, so `init_value`, checkpoints and recomputation see the same names. What the split
means for each parameter (its shard, a partial gradient under SP) is the model contract's
(`ModelContract.tensor_parallel`, from the declarations in models/declare.py): the model
adopts it at the end, which checks that the plan made exactly the declared shards.

Per block, with t = tp (Shoeybi et al., 2019, section 3; Korthikanti et al., 2022):

    attention: enter (f | SP all-gather) -> wq, wk, wv column -> a/t, kv/t local heads
               -> core (dropout on local heads) -> wo row -> g | SP reduce-scatter
    MLP:       enter -> fc1 column -> GELU -> fc2 row -> g | SP reduce-scatter
               enter -> w_gate, w_up column -> SiLU * -> w_down row -> g | SP reduce-scatter
    under SP:  norms and residual dropouts work on the (b, s/t, h) sequence shard

Call it on the meta model before `to_empty` and `init_parameters` (build/model.py build_model's
`parallelize` hook): shards are created where the replaced layers live and are filled by
`init_parameters` with their slice of the single-process value. Called on a materialized
model, each shard is cut from the existing full weights instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from plait.comm import Comm
from plait.composition import check_tensor_parallel
from plait.mesh import Mesh
from plait.models.architecture import ModelConfig
from plait.models.block_table import block_table
from plait.models.contract import ParamDecl
from plait.models.transformer import Transformer
from plait.parallel.tp.layers import (
    ColumnParallelLinear,
    EnterRegion,
    RowParallelLinear,
    ShardedDropout,
)
from plait.parallel.tp.vocab import ParallelEmbedding, VocabParallelCrossEntropy


# ---------------------------------------------------------------- styles
@dataclass(frozen=True)
class TPContext:
    """What every style needs: the communicator, whether sequence parallelism is on, and the
    declarations of a block's parameters on this rank (the split contract's), by leaf."""

    comm: Comm
    sequence_parallel: bool
    declared: tuple[ParamDecl, ...] = ()

    def linear(self, path: str) -> list[ParamDecl]:
        """The declarations of the Linear at `path`, named as the layer names them."""
        at = f"{path}."
        return [replace(d, leaf=d.leaf[len(at) :]) for d in self.declared if d.leaf.startswith(at)]


Style = Callable[[nn.Module, str, TPContext], None]
"""Transforms the submodule at `path` of `root` in place (replacing it or hooking it)."""


def colwise(root: nn.Module, path: str, ctx: TPContext) -> None:
    """Column-parallel; entered once by the block (EnterRegion), not per layer."""
    linear = root.get_submodule(path)
    layer = ColumnParallelLinear.from_linear(linear, ctx.comm, ctx.linear(path), enter=False)
    root.set_submodule(path, layer)


def rowwise(root: nn.Module, path: str, ctx: TPContext) -> None:
    """Row-parallel; its output leaves the region (g, or reduce-scatter under SP)."""
    layer = RowParallelLinear.from_linear(
        root.get_submodule(path),
        ctx.comm,
        ctx.linear(path),
        sequence_parallel=ctx.sequence_parallel,
    )
    root.set_submodule(path, layer)


def enter(root: nn.Module, path: str, ctx: TPContext) -> None:
    """The block's input enters the tp region once for all its column-parallel layers."""
    hook = EnterRegion(ctx.comm, ctx.sequence_parallel)
    root.get_submodule(path).register_forward_pre_hook(hook)


def shard_dim1_dropout(root: nn.Module, path: str, ctx: TPContext) -> None:
    """Dropout on a tensor split along dim 1: heads (b, a/t, s, s) or sequence (b, s/t, h)."""
    root.set_submodule(path, ShardedDropout.from_dropout(root.get_submodule(path), 1, ctx.comm))


def block_plan(arch: ModelConfig, sequence_parallel: bool) -> dict[str, Style]:
    """Module path within a Block -> style, in application order: each Linear of the block
    table (models/block_table.py) by its style, the sublayer holding column-parallel ones
    entered once before them, the attention's dropout on its local heads."""
    plan: dict[str, Style] = {}
    for row in block_table(arch).linears:
        if row.style == "column" and row.sublayer not in plan:
            plan[row.sublayer] = enter
        plan[row.path] = colwise if row.style == "column" else rowwise
    plan["attn.core.drop"] = shard_dim1_dropout  # probabilities of the local heads
    if sequence_parallel:  # the norms run on sequence shards unchanged (contract: partial)
        plan |= {"attn_drop": shard_dim1_dropout, "mlp_drop": shard_dim1_dropout}
    return plan


def apply_plan(root: nn.Module, plan: dict[str, Style], ctx: TPContext) -> None:
    for path, style in plan.items():
        style(root, path, ctx)


# ---------------------------------------------------------------- the model
def apply_tensor_parallel(
    model: Transformer, mesh: Mesh, comm: Comm, sequence_parallel: bool = False
) -> Transformer:
    """Shard `model` (a models.transformer.Transformer) over the mesh's tp axis, in place.

    Returns the model. With tp = 1 nothing changes. The loss becomes vocabulary-parallel
    (`model.loss`), and logits returned without targets are this rank's vocabulary slice
    (b, s, V_padded/tp); `gather_logits` assembles them.
    """
    if comm.mesh is not mesh:
        raise ValueError("comm must be built on the same mesh that is passed")
    tp = mesh.size("tp")
    arch: ModelConfig = model.cfg
    check_tensor_parallel(arch, tp, sequence_parallel)
    if tp == 1:
        return model
    contract = model.contract
    if contract.tp_size > 1:
        raise ValueError("apply_tensor_parallel was already applied to this model")
    split = contract.tensor_parallel(mesh.axis_rank("tp"), tp, sequence_parallel)
    plan = block_plan(arch, sequence_parallel)
    for part in split.blocks():  # every block shares one tuple of declarations
        apply_plan(
            model.get_submodule(part.path), plan, TPContext(comm, sequence_parallel, part.params)
        )
    head = next(part for part in split.parts if part.kind == "head")
    _apply_model_level(model, TPContext(comm, sequence_parallel, head.params))
    # Adopting the split contract re-ties the head to the embedding shard (same rows, same
    # padding) and fails loudly if the plan and the declarations disagree on a shape.
    model.set_contract(split)
    return model


def _apply_model_level(model: Transformer, ctx: TPContext) -> None:
    """Embedding, head (as `ctx.declared`, the head's declarations) and loss (the final norm,
    replicated, runs unchanged)."""
    arch: ModelConfig = model.cfg
    embed = model.embed
    pos = embed.pos if arch.pos == "learned" else None
    model.embed = ParallelEmbedding(
        embed.tok, pos, embed.drop, ctx.comm, ctx.sequence_parallel, embed.scaled
    )
    model.head = ColumnParallelLinear.from_linear(
        model.head,
        ctx.comm,
        list(ctx.declared),  # the vocabulary, padded to a multiple of tp
        enter=True,
        sequence_parallel=ctx.sequence_parallel,
        tag="tp-head",
    )
    model.loss = VocabParallelCrossEntropy(arch.vocab_size, ctx.comm)
