"""plait parameter names <-> Hugging Face tensor names and layouts (one home for the map).

Every block parameter's place comes from the block table (models/block_table.py): its module's
Hugging Face name, whether Hugging Face stores it transposed, and its offset in a fused module.
plait's Llama attention already uses Hugging Face's layout: rotate-half RoPE over pairs (i, i +
hd/2) and query head j reading kv head j // (a / kv) (`repeat_kv`), so q/k need no permutation
and every Llama tensor maps by name alone. GPT-2 differs in two ways: its Conv1D stores weights
(in, out), the transpose of nn.Linear, and one `c_attn` holds q, k and v stacked along its
output dimension, so plait's wq/wk/wv are column ranges of it; Phi-3 stacks q, k, v in one
`qkv_proj` and gate, up in one `gate_up_proj` the same way (untransposed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from plait.models.architecture import ModelConfig
from plait.models.block_table import NormRow, block_table, table_for
from plait.models.hf.config_json import GPT2, family
from plait.models.init import canonical_name


@dataclass(frozen=True)
class Piece:
    """Where one plait parameter lives in a Hugging Face tensor.

    `transpose`: the HF tensor is (in, out) (GPT-2 Conv1D). `offset`: the parameter starts
    at this index of the HF tensor's output dimension (q, k, v inside GPT-2's c_attn).
    """

    hf_name: str
    transpose: bool = False
    offset: int = 0

    def hf_region(self, region: tuple[slice, ...]) -> tuple[slice, ...]:
        """The HF tensor's index for a region of the plait parameter."""
        out = slice(region[0].start + self.offset, region[0].stop + self.offset)
        if self.transpose:
            return (*region[1:], out)
        return (out, *region[1:])

    def to_plait(self, hf_part: Tensor) -> Tensor:
        return hf_part.t() if self.transpose else hf_part


def block_pieces(cfg: ModelConfig, prefix: str) -> dict[str, Piece]:
    """A block's parameters (plait paths in a block) -> their places under the Hugging Face
    block `prefix`, from the block table: each norm's and Linear's module by its `hf` name,
    stored (in, out) when the table says so, at the offset its row has in a fused module."""
    table = block_table(cfg)
    out: dict[str, Piece] = {}
    for row in table.rows:
        if isinstance(row, NormRow):
            biased = cfg.norm == "layernorm" and cfg.bias and row.over == "h"
            leaves = ("weight", "bias") if biased else ("weight",)
            for leaf in leaves:
                out[f"{row.path}.{leaf}"] = Piece(f"{prefix}{row.hf}.{leaf}")
            continue
        offset = table.hf_offset(row.path, cfg)
        out[f"{row.path}.weight"] = Piece(f"{prefix}{row.hf}.weight", table.hf_transposed, offset)
        if row.has_bias(cfg):
            out[f"{row.path}.bias"] = Piece(f"{prefix}{row.hf}.bias", False, offset)
    return out


def _blocks(cfg: ModelConfig, prefix: str) -> dict[str, Piece]:
    return {
        f"blocks.{i}.{ours}": piece
        for i in range(cfg.n_layers)
        for ours, piece in block_pieces(cfg, f"{prefix}.{i}.").items()
    }


def _llama(cfg: ModelConfig) -> dict[str, Piece]:
    names = {"embed.tok.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["head.weight"] = "lm_head.weight"
    return {ours: Piece(theirs) for ours, theirs in names.items()} | _blocks(cfg, "model.layers")


def _gpt2(cfg: ModelConfig) -> dict[str, Piece]:
    out = {
        "embed.tok.weight": Piece("transformer.wte.weight"),
        "embed.pos.weight": Piece("transformer.wpe.weight"),
        "norm.weight": Piece("transformer.ln_f.weight"),
        "norm.bias": Piece("transformer.ln_f.bias"),
    }
    return out | _blocks(cfg, "transformer.h")


def block_linears(arch: str) -> dict[str, str]:
    """Each Linear of a block by its plait path ('attn.wq') -> its Hugging Face module path in
    the block (LLaMA 'self_attn.q_proj'; GPT-2's wq, wk and wv all 'attn.c_attn')."""
    return {row.path: row.hf for row in table_for(arch).linears}


def pieces(cfg: ModelConfig) -> dict[str, Piece]:
    """Every single-process plait parameter name (a tied head under the embedding's name)
    -> its place in the Hugging Face state dict."""
    return _gpt2(cfg) if family(cfg) == GPT2 else _llama(cfg)


def piece(cfg: ModelConfig, table: dict[str, Piece], name: str) -> Piece:
    """The Piece of a parameter by any of its names (wrappers, a tied head)."""
    return table[canonical_name(cfg, name)]


def to_hf(cfg: ModelConfig, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """Full single-process plait tensors -> the Hugging Face state dict (fused, transposed)."""
    return assemble(pieces(cfg), params)


def assemble(table: dict[str, Piece], params: dict[str, Tensor]) -> dict[str, Tensor]:
    """The Hugging Face tensors `table` describes, from full plait tensors: the parameters
    that share one HF tensor (GPT-2's q, k, v) stacked by offset, transposed where stored so."""
    parts: dict[str, list[tuple[int, Tensor, bool]]] = {}
    for name, p in table.items():
        parts.setdefault(p.hf_name, []).append((p.offset, params[name], p.transpose))
    out = {}
    for hf_name, group in parts.items():
        group.sort(key=lambda g: g[0])
        transpose = group[0][2]
        out[hf_name] = torch.cat([t for _, t, _ in group], dim=0)
        if transpose:
            out[hf_name] = out[hf_name].t()
        out[hf_name] = out[hf_name].contiguous()
    return out
