"""Which parameters a rank holds, counted from the config alone (no model is built).

The list follows `models/transformer.py`'s registration order (embedding, blocks, final norm,
head) with the shapes tensor parallelism gives each shard (`parallel/tp/`): column-parallel
outputs and the vocabulary split t ways, the vocabulary padded to a multiple of t,
row-parallel biases and norms replicated. A pipeline rank keeps only its stages' blocks, the
embedding on the first stage and the final norm and head on the last; a tied embedding is one
parameter when one rank holds both ends and a copy on each end otherwise
(`runtime/stage.py`). The ZeRO engine's flat groups are formed from this list
(`estimate/states.py`), so padding and buckets come out as the engine makes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.models.architecture import ModelConfig
from plait.schedule.stages import StagePlan


@dataclass(frozen=True)
class ParamSpec:
    """One parameter (or tp shard) on a rank: `block` is its transformer block, None for
    the embedding, final norm and head (ZeRO-3's root unit)."""

    name: str
    numel: int
    block: int | None
    isolated: bool = False  # a tied embedding copy on a pipeline end: a flat group alone
    tp_partial: bool = False  # under sequence parallelism its gradient is summed over tp


def padded_vocab(cfg: ModelConfig, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp (`tp/vocab.py`)."""
    return -(-cfg.vocab_size // tp) * tp


def _norm(cfg: ModelConfig, name: str, block: int | None) -> list[ParamSpec]:
    h = cfg.d_model
    out = [ParamSpec(f"{name}.weight", h, block, tp_partial=True)]  # acts on s/t tokens
    if cfg.norm == "layernorm" and cfg.bias:
        out.append(ParamSpec(f"{name}.bias", h, block, tp_partial=True))
    return out


def _linear(
    cfg: ModelConfig, name: str, shape: tuple[int, int], bias: int, block: int, row: bool = False
) -> list[ParamSpec]:
    """A Linear (out, in) shard; `bias` is the bias length on this rank (when biases exist);
    `row`: row-parallel, whose replicated bias is added to the sequence-split output."""
    out = [ParamSpec(f"{name}.weight", shape[0] * shape[1], block)]
    if cfg.bias:
        out.append(ParamSpec(f"{name}.bias", bias, block, tp_partial=row))
    return out


def block_params(cfg: ModelConfig, i: int, tp: int) -> list[ParamSpec]:
    """Block i's parameters on one tp rank, in registration order."""
    h, hd, f = cfg.d_model, cfg.head_dim, cfg.ffn_dim
    q, kv = cfg.n_heads * hd // tp, cfg.kv_heads * hd // tp
    pre = f"blocks.{i}"
    out = _norm(cfg, f"{pre}.attn_norm", i)
    out += _linear(cfg, f"{pre}.attn.wq", (q, h), q, i)
    out += _linear(cfg, f"{pre}.attn.wk", (kv, h), kv, i)
    out += _linear(cfg, f"{pre}.attn.wv", (kv, h), kv, i)
    out += _linear(cfg, f"{pre}.attn.wo", (h, q), h, i, row=True)
    out += _norm(cfg, f"{pre}.mlp_norm", i)
    if cfg.mlp == "swiglu":
        out += _linear(cfg, f"{pre}.mlp.w_gate", (f // tp, h), f // tp, i)
        out += _linear(cfg, f"{pre}.mlp.w_up", (f // tp, h), f // tp, i)
        out += _linear(cfg, f"{pre}.mlp.w_down", (h, f // tp), h, i, row=True)
    else:
        out += _linear(cfg, f"{pre}.mlp.fc1", (f // tp, h), f // tp, i)
        out += _linear(cfg, f"{pre}.mlp.fc2", (h, f // tp), h, i, row=True)
    return out


def rank_params(cfg: ModelConfig, tp: int, plans: list[StagePlan]) -> list[ParamSpec]:
    """Every parameter one (pp, tp) rank holds, in registration order (unique: a tied
    embedding held at both ends by this rank is listed once)."""
    first = any(p.first for p in plans)
    last = any(p.last for p in plans)
    pipelined = not (first and last)
    table = padded_vocab(cfg, tp) // tp * cfg.d_model
    out: list[ParamSpec] = []
    if first:
        out.append(ParamSpec("embed.tok.weight", table, None, cfg.tie_embeddings and pipelined))
        if cfg.pos == "learned":
            pos = cfg.max_seq_len * cfg.d_model  # added to the sequence-split embedding
            out.append(ParamSpec("embed.pos.weight", pos, None, tp_partial=True))
    for i in sorted(i for plan in plans for i in plan.layers):
        out += block_params(cfg, i, tp)
    if last:
        out += _norm(cfg, "norm", None)
        if not (cfg.tie_embeddings and first):
            out.append(ParamSpec("head.weight", table, None, cfg.tie_embeddings))
    return out


def total_parameters(cfg: ModelConfig) -> int:
    """Ψ: the single-process model's unique parameters (`count_parameters` without torch).
    Every block has the same shapes, so one block is counted and multiplied (a planner calls
    this for thousands of layouts)."""
    ends = rank_params(cfg, 1, [StagePlan(0, range(0), True, True)])
    return sum(p.numel for p in ends) + cfg.n_layers * sum(p.numel for p in block_params(cfg, 0, 1))
