"""plait parameter names <-> Hugging Face tensor names and layouts (one home for the map).

plait's Llama attention already uses Hugging Face's layout: rotate-half RoPE over pairs
(i, i + hd/2) and query head j reading kv head j // (a / kv) (`repeat_kv`), so q/k need no
permutation and every Llama tensor maps by name alone. GPT-2 differs in two ways: its
Conv1D stores weights (in, out), the transpose of nn.Linear, and one `c_attn` holds q, k and
v stacked along its output dimension, so plait's wq/wk/wv are column ranges of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from plait.models.architecture import ModelConfig
from plait.models.hf.config_json import LLAMA, family
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


_LLAMA_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}


def _llama(cfg: ModelConfig) -> dict[str, Piece]:
    names = {"embed.tok.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        for ours, theirs in _LLAMA_BLOCK.items():
            names[f"blocks.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return {ours: Piece(theirs) for ours, theirs in names.items()}


def _gpt2_block(i: int, d: int) -> dict[str, Piece]:
    h = f"transformer.h.{i}"
    out: dict[str, Piece] = {}
    for norm, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
        for leaf in ("weight", "bias"):
            out[f"blocks.{i}.{norm}.{leaf}"] = Piece(f"{h}.{theirs}.{leaf}")
    for k, proj in enumerate(("wq", "wk", "wv")):  # c_attn's output is [q | k | v]
        out[f"blocks.{i}.attn.{proj}.weight"] = Piece(f"{h}.attn.c_attn.weight", True, k * d)
        out[f"blocks.{i}.attn.{proj}.bias"] = Piece(f"{h}.attn.c_attn.bias", False, k * d)
    for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"),
                         ("mlp.fc2", "mlp.c_proj")):  # fmt: skip
        out[f"blocks.{i}.{ours}.weight"] = Piece(f"{h}.{theirs}.weight", True)
        out[f"blocks.{i}.{ours}.bias"] = Piece(f"{h}.{theirs}.bias")
    return out


def _gpt2(cfg: ModelConfig) -> dict[str, Piece]:
    out = {
        "embed.tok.weight": Piece("transformer.wte.weight"),
        "embed.pos.weight": Piece("transformer.wpe.weight"),
        "norm.weight": Piece("transformer.ln_f.weight"),
        "norm.bias": Piece("transformer.ln_f.bias"),
    }
    for i in range(cfg.n_layers):
        out.update(_gpt2_block(i, cfg.d_model))
    return out


def block_linears(mlp: str) -> dict[str, str]:
    """Each Linear of a block by its plait path ('attn.wq') -> its Hugging Face module path in
    the block (LLaMA 'self_attn.q_proj'; GPT-2's wq, wk and wv all 'attn.c_attn')."""
    if mlp == "swiglu":
        names = dict(_LLAMA_BLOCK)
    else:
        names = {ours.removeprefix("blocks.0."): p.hf_name.removeprefix("transformer.h.0.")
                 for ours, p in _gpt2_block(0, 1).items()}  # fmt: skip
    return {
        ours.removesuffix(".weight"): theirs.removesuffix(".weight")
        for ours, theirs in names.items()
        if ours.split(".")[0] in ("attn", "mlp") and ours.endswith(".weight")
    }


def pieces(cfg: ModelConfig) -> dict[str, Piece]:
    """Every single-process plait parameter name (a tied head under the embedding's name)
    -> its place in the Hugging Face state dict."""
    return _llama(cfg) if family(cfg) == LLAMA else _gpt2(cfg)


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
