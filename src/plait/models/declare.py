"""The transformer's contract, declared from its config alone (models/contract.py says why).

`describe(cfg)` lists every parameter of models/transformer.py in registration order, with
what each means to parallel code (Shoeybi et al., 2019, section 3; Korthikanti et al., 2022):

- each Linear of the block table (models/block_table.py, which says which are which):
  column-parallel weights and their biases split dim 0, by output features; row-parallel
  weights split dim 1, by input features; LoRA's A and B split as their weight does;
- the token embedding and the head split dim 0, the vocabulary, padded to a multiple of tp;
- what acts on each position alone and is replicated (norm gains and biases, row-parallel
  biases, learned positions) has a partial gradient under sequence parallelism;
- the head is tied to the token embedding when the config says so.

This is the one place a parameter is declared (a block's rows come from its table). A new kind, such
as a trainable adapter beside a frozen base weight, is a `ParamDecl` here (its leaf, shape, split
dimension, `trainable`); the model must then register exactly that parameter (`ModelContract.check`
says if not).
"""

from __future__ import annotations

from dataclasses import replace

from plait.models.architecture import ModelConfig
from plait.models.block_table import NormRow, Style, block_table
from plait.models.contract import ModelContract, ParamDecl, Part


def _norm(cfg: ModelConfig, leaf: str, row: NormRow | None = None) -> tuple[ParamDecl, ...]:
    """A norm acts on each position alone: under SP a rank sees only its positions. A norm
    over each head (`row.over == "head"`) follows a column-parallel projection, which gathers
    the sequence first: a rank sees every position but only its heads."""
    if row is not None and row.over == "head":
        return (ParamDecl(f"{leaf}weight", (cfg.head_dim,), tp_partial=True),)
    h = cfg.d_model
    out = [ParamDecl(f"{leaf}weight", (h,), sp_partial=True)]
    if cfg.norm == "layernorm" and cfg.bias:
        out.append(ParamDecl(f"{leaf}bias", (h,), sp_partial=True))
    return tuple(out)


def linear_params(
    path: str,
    widths: tuple[int, int],
    style: Style,
    bias: bool,
    adapter: tuple[int, bool] | None = None,
    padded: bool = False,
) -> list[ParamDecl]:
    """A Linear (out, in) at `path` ('' for the layer itself): column-parallel splits dim 0
    (its bias too); row-parallel splits dim 1 and adds its replicated bias to every position
    of the summed output. `adapter` (rank, whether it holds its A) adds LoRA's A and B, split
    as the weight is (`adapter_params`). The tensor-parallel layers split these same
    declarations (parallel/tp/layers.py)."""
    out_f, in_f = widths
    row = style == "row"
    at = f"{path}." if path else ""
    weight = ParamDecl(f"{at}weight", (out_f, in_f), split_dim=1 if row else 0, padded=padded)
    out = [weight]
    if bias:
        split = None if row else 0
        out.append(ParamDecl(f"{at}bias", (out_f,), split, padded and not row, sp_partial=row))
    if adapter is not None:
        out += adapter_params(weight, *adapter)
    return out


def adapter_params(weight: ParamDecl, rank: int, holds_a: bool) -> list[ParamDecl]:
    """LoRA's A (r, in) and B (out, r) beside `weight` (out, in), each split along the
    dimension it shares with the weight where the weight is split there, else replicated
    (docs/lora.md; torchtitan's `_adapter_sharding` has the same rule). Column-parallel, B is
    split by output, so each rank's B sees its output slice, and the replicated A feeds split
    outputs, so its gradient is partial over tp (`tp_partial`); row-parallel, A is split by
    input (its product is summed with the base's) and the replicated B is applied per
    position (partial under SP, like the row-parallel bias)."""
    at = weight.leaf.removesuffix("weight")
    out_f, in_f = weight.shape
    by_in, by_out = weight.split_dim == 1, weight.split_dim == 0
    out = []
    if holds_a:
        split = 1 if by_in else None
        out.append(ParamDecl(f"{at}lora_a", (rank, in_f), split, tp_partial=by_out))
    split = 0 if by_out else None
    out.append(
        ParamDecl(f"{at}lora_b", (out_f, rank), split, weight.padded and by_out, sp_partial=by_in)
    )
    return out


def is_adapter(leaf: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (A or B)."""
    return leaf.rpartition(".")[2] in ("lora_a", "lora_b")


def block_params(cfg: ModelConfig) -> tuple[ParamDecl, ...]:
    """One block's parameters (every block has the same), in registration order: the
    block table's rows (models/block_table.py), each Linear with its adapter if targeted."""
    spec = cfg.lora
    out: list[ParamDecl] = []
    for row in block_table(cfg).rows:
        if isinstance(row, NormRow):
            out += _norm(cfg, f"{row.path}.", row)
            continue
        adapter = None
        if spec is not None and row.path in spec.leaves:
            adapter = (spec.rank, spec.has_a(row.path))
        out += linear_params(row.path, row.widths(cfg), row.style, row.has_bias(cfg), adapter)
    return tuple(out)


def describe(cfg: ModelConfig) -> ModelContract:
    """The single-process transformer of `cfg`: every part held, nothing split."""
    table = (cfg.vocab_size, cfg.d_model)
    embed = [ParamDecl("tok.weight", table, split_dim=0, padded=True)]
    if cfg.pos == "learned":  # added to each position's embedding
        embed.append(ParamDecl("pos.weight", (cfg.max_seq_len, cfg.d_model), sp_partial=True))
    tied = "embed.tok.weight" if cfg.tie_embeddings else None  # the one tying rule
    head = ParamDecl("weight", table, split_dim=0, padded=True, tied_to=tied)
    block = _base_frozen(cfg, block_params(cfg))  # one tuple shared by every block
    return ModelContract(
        (
            Part.end("embed", _base_frozen(cfg, tuple(embed))),
            *(Part.block(i, block) for i in range(cfg.n_layers)),
            Part.end("norm", _base_frozen(cfg, _norm(cfg, ""))),
            Part.end("head", _base_frozen(cfg, (head,))),
        )
    )


def _base_frozen(cfg: ModelConfig, decls: tuple[ParamDecl, ...]) -> tuple[ParamDecl, ...]:
    """Under LoRA only the adapters train: every other parameter is frozen (PEFT's
    default, bias 'none'), declared so here, once per tuple (blocks keep sharing theirs)."""
    if cfg.lora is None:
        return decls
    return tuple(replace(d, trainable=is_adapter(d.leaf)) for d in decls)
