"""The transformer's contract, declared from its config alone (models/contract.py says why).

`describe(cfg)` lists every parameter of models/transformer.py in registration order, with
what each means to parallel code (Shoeybi et al., 2019, section 3; Korthikanti et al., 2022):

- column-parallel matrices (wq, wk, wv, fc1, w_gate, w_up) and their biases split dim 0, by
  output features; row-parallel matrices (wo, fc2, w_down) split dim 1, by input features;
- the token embedding and the head split dim 0, the vocabulary, padded to a multiple of tp;
- what acts on each position alone and is replicated (norm gains and biases, row-parallel
  biases, learned positions) has a partial gradient under sequence parallelism;
- the head is tied to the token embedding when the config says so.

This is the one place a parameter is declared. A new kind, such as a trainable adapter beside
a frozen base weight, is a `ParamDecl` here (its leaf, shape, split dimension, `trainable`);
the model must then register exactly that parameter (`ModelContract.check` says if not).
"""

from __future__ import annotations

from dataclasses import replace

from plait.models.architecture import ModelConfig
from plait.models.contract import ModelContract, ParamDecl, Part


def tied_names(cfg: ModelConfig) -> dict[str, str]:
    """Tied copy -> the canonical name of the parameter it shares values with."""
    return {"head.weight": "embed.tok.weight"} if cfg.tie_embeddings else {}


def _norm(cfg: ModelConfig, leaf: str) -> tuple[ParamDecl, ...]:
    """A norm acts on each position alone: under SP a rank sees only its positions."""
    h = cfg.d_model
    out = [ParamDecl(f"{leaf}weight", (h,), sp_partial=True)]
    if cfg.norm == "layernorm" and cfg.bias:
        out.append(ParamDecl(f"{leaf}bias", (h,), sp_partial=True))
    return tuple(out)


def _linear(cfg: ModelConfig, leaf: str, out_f: int, in_f: int, row: bool) -> list[ParamDecl]:
    """A Linear (out, in): column-parallel splits dim 0 (its bias too); row-parallel splits
    dim 1 and adds its replicated bias to every position of the summed output. Then its
    adapter, if LoRA targets it (`_adapter`)."""
    out = [ParamDecl(f"{leaf}.weight", (out_f, in_f), split_dim=1 if row else 0)]
    if cfg.bias:
        bias = ParamDecl(f"{leaf}.bias", (out_f,), split_dim=None if row else 0, sp_partial=row)
        out.append(bias)
    return out + _adapter(cfg, leaf, out_f, in_f, row)


def _adapter(cfg: ModelConfig, leaf: str, out_f: int, in_f: int, row: bool) -> list[ParamDecl]:
    """LoRA's A (r, in) and B (out, r) beside a targeted Linear, split as its base is
    (docs/lora.md): column-parallel, A is replicated and B split by output, so each rank's
    B sees its output slice and A's gradient is partial over tp (`tp_partial`); row-parallel,
    A is split by input (its product is summed with the base's) and B is replicated and
    applied per position (partial under SP, like the row-parallel bias)."""
    spec = cfg.lora
    if spec is None or leaf not in spec.leaves:
        return []
    r = spec.rank
    out = []
    if spec.has_a(leaf):
        a = ParamDecl(f"{leaf}.lora_a", (r, in_f), split_dim=1 if row else None, tp_partial=not row)
        out.append(a)
    out.append(
        ParamDecl(f"{leaf}.lora_b", (out_f, r), split_dim=None if row else 0, sp_partial=row)
    )
    return out


def is_adapter(leaf: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (A or B)."""
    return leaf.rpartition(".")[2] in ("lora_a", "lora_b")


def block_params(cfg: ModelConfig) -> tuple[ParamDecl, ...]:
    """One block's parameters (every block has the same), in registration order."""
    h, f = cfg.d_model, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out = [*_norm(cfg, "attn_norm.")]
    out += _linear(cfg, "attn.wq", q, h, row=False)
    out += _linear(cfg, "attn.wk", kv, h, row=False)
    out += _linear(cfg, "attn.wv", kv, h, row=False)
    out += _linear(cfg, "attn.wo", h, q, row=True)
    out += _norm(cfg, "mlp_norm.")
    if cfg.mlp == "swiglu":
        out += _linear(cfg, "mlp.w_gate", f, h, row=False)
        out += _linear(cfg, "mlp.w_up", f, h, row=False)
        out += _linear(cfg, "mlp.w_down", h, f, row=True)
    else:
        out += _linear(cfg, "mlp.fc1", f, h, row=False)
        out += _linear(cfg, "mlp.fc2", h, f, row=True)
    return tuple(out)


def describe(cfg: ModelConfig) -> ModelContract:
    """The single-process transformer of `cfg`: every part held, nothing split."""
    table = (cfg.vocab_size, cfg.d_model)
    embed = [ParamDecl("tok.weight", table, split_dim=0, padded=True)]
    if cfg.pos == "learned":  # added to each position's embedding
        embed.append(ParamDecl("pos.weight", (cfg.max_seq_len, cfg.d_model), sp_partial=True))
    tied = tied_names(cfg).get("head.weight")
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
