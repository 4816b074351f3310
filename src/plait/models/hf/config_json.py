"""Hugging Face config.json <-> plait's ModelConfig, refusing what plait cannot express.

plait's one decoder family covers the Llama-like Hugging Face architectures (RMSNorm, SwiGLU,
rotate-half RoPE, grouped-query attention): LlamaForCausalLM (no biases; Llama 3's `llama3`
RoPE rescale), Qwen2ForCausalLM (biases on q, k, v), Qwen3ForCausalLM (per-head q/k norms,
its own head size) and Phi3ForCausalLM (fused projections: models/hf/mapping.py), each a
`model.family` with its block table; and GPT2LMHeadModel (LayerNorm, tanh-GELU MLP, learned
positions, tied head, biases). Every config field that
changes the forward pass is either mapped or refused here, naming the field, so a model that
loads computes what `transformers` computes. Dropout is a training choice: plait's
`model.dropout` applies, the folder's dropout fields are not read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plait.errors import ConfigError
from plait.models.architecture import ModelConfig
from plait.models.hf.config_gemma import GEMMA_TYPES, check_gemma, gemma_config, gemma_fields
from plait.models.nf4.hf import folder_scheme

LLAMA, GPT2, QWEN2, QWEN3, PHI3 = "llama", "gpt2", "qwen2", "qwen3", "phi3"
MISTRAL = "mistral"
ARCHITECTURES = {
    LLAMA: "LlamaForCausalLM",
    QWEN2: "Qwen2ForCausalLM",
    QWEN3: "Qwen3ForCausalLM",
    PHI3: "Phi3ForCausalLM",
    GPT2: "GPT2LMHeadModel",
    MISTRAL: "MistralForCausalLM",
}
SWITCHES = {LLAMA: ("attention_bias", "mlp_bias"), QWEN3: ("attention_bias",), MISTRAL: ()}
MISTRAL_WINDOW = 4096  # MistralConfig's sliding_window when config.json has none (v0.1)
"""Each Llama-like family's bias switches, which plait reads only off (False)."""
LLAMA3_FIELDS = {
    "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max": "original_max_position_embeddings",
}
"""ModelConfig's Llama 3 RoPE fields -> their key in a rope_type "llama3" config."""
# GPT-2's "gelu_new" is the tanh approximation plait's MLP computes.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of a Hugging Face model folder, or ConfigError naming what is wrong."""
    return read_json_object(folder, "config.json", "--init-from", "a Hugging Face folder")


def read_json_object(folder: Path, name: str, flag: str, kind: str, note: str = "") -> dict:
    """The JSON object in `folder`/`name` (a model's or an adapter's config), or one
    ConfigError naming the folder given to `flag`, or the file, and what is wrong with it."""
    if not folder.is_dir():
        raise ConfigError(f"{flag} {str(folder)!r} is not a folder{note}")
    path = folder / name
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{str(path)!r} does not exist ({kind} has one)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{str(path)!r} is not readable JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{str(path)!r} must hold a JSON object")
    return raw


def family_of(hf: dict[str, Any], where: str) -> str:
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES and kind not in GEMMA_TYPES:
        known = ", ".join([*ARCHITECTURES, *GEMMA_TYPES])
        raise ConfigError(f"{where}: model_type={kind!r} is not one plait reads ({known})")
    return kind


def _refuse(where: str, field: str, value: Any, need: str) -> None:
    raise ConfigError(f"{where}: {field}={value!r} cannot be expressed by plait's model ({need})")


def _expect(hf: dict[str, Any], where: str, field: str, allowed: tuple, default: Any) -> None:
    value = hf.get(field, default)
    if value not in allowed:
        _refuse(where, field, value, "needs " + " or ".join(repr(a) for a in allowed))


def _rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """RoPE base and Llama 3's rescale; transformers 5 keeps them in `rope_parameters`, 4.x
    in `rope_theta` and `rope_scaling`. Any other rope_type (Phi-3's longrope, yarn,
    linear, dynamic) and a partial rotation are refused, naming the field."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    out: dict[str, Any] = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 1e4)))}
    for field, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind == "llama3":
            out |= {ours: float(spec[theirs]) for ours, theirs in LLAMA3_FIELDS.items()}
        elif kind != "default":
            _refuse(where, f"{field}.rope_type", kind, "plain RoPE or llama3 only")
        part = spec.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if part != 1.0:
            _refuse(where, "partial_rotary_factor", part, "RoPE over the whole head only")
    if "rope_original_max" in out:
        out["rope_original_max"] = int(out["rope_original_max"])
    return out


def _llama(hf: dict[str, Any], where: str, kind: str) -> ModelConfig:
    """The Llama-like families: LLaMA's block, Qwen3's per-head q/k norms and head size."""
    _expect(hf, where, "hidden_act", ("silu",), "silu")
    for switch in SWITCHES.get(kind, ()):
        _expect(hf, where, switch, (False,), False)
    if kind in (QWEN2, QWEN3):  # Qwen's optional sliding windows
        _expect(hf, where, "use_sliding_window", (False,), False)
    if kind == PHI3:  # Phi-3-mini-4k's 2047: rows up to that length would be exact
        _expect(hf, where, "sliding_window", (None,), None)
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // heads
    return ModelConfig(
        family="" if kind == LLAMA else kind,
        head_size=None if head_dim * heads == d else head_dim,
        vocab_size=hf["vocab_size"],
        n_layers=hf["num_hidden_layers"],
        d_model=d,
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm="rmsnorm",
        mlp="swiglu",
        pos="rope",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bias=False,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        **_rope(hf, where),
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def _mistral_window(hf: dict[str, Any]) -> int | None:
    """Mistral's window, in every layer (v0.1: 4096; v0.3 writes null: none); MistralConfig
    reads no layer_types."""
    return hf.get("sliding_window", MISTRAL_WINDOW)


def _gpt2(hf: dict[str, Any], where: str) -> ModelConfig:
    _expect(hf, where, "activation_function", TANH_GELU, "gelu_new")
    _expect(hf, where, "scale_attn_weights", (True,), True)
    _expect(hf, where, "scale_attn_by_inverse_layer_idx", (False,), False)
    _expect(hf, where, "add_cross_attention", (False,), False)
    _expect(hf, where, "tie_word_embeddings", (True,), True)
    d = hf.get("n_embd", 768)
    return ModelConfig(
        vocab_size=hf.get("vocab_size", 50257),
        n_layers=hf.get("n_layer", 12),
        d_model=d,
        n_heads=hf.get("n_head", 12),
        ffn_hidden=hf.get("n_inner") or 4 * d,
        max_seq_len=hf.get("n_positions", 1024),
        norm="layernorm",
        mlp="gelu",
        pos="learned",
        tie_embeddings=True,
        bias=True,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def from_hf_config(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """plait's ModelConfig for a Hugging Face config; ConfigError naming a field it can't."""
    folder_scheme(hf, where)  # a quantized folder: NF4 (QLoRA) read, any other refused
    try:
        kind = family_of(hf, where)
        if kind in GEMMA_TYPES:
            return _checked(gemma_config(hf, where, kind))
        cfg = _gpt2(hf, where) if kind == GPT2 else _llama(hf, where, kind)
        if kind == MISTRAL:
            cfg.sliding_window = _mistral_window(hf)
    except KeyError as e:
        raise ConfigError(f"{where}: the field {e.args[0]!r} is missing") from e
    return _checked(cfg)


def _checked(cfg: ModelConfig) -> ModelConfig:
    cfg.validate()
    return cfg


def _gemma_only(cfg: ModelConfig) -> None:
    """What only a Gemma folder holds (scores scaled apart from the head size, soft-caps, a
    local RoPE base, alternating windows), refused elsewhere, naming the first one set."""
    gemma_fields = {
        "attn_scalar": cfg.attn_scalar,
        "attn_softcap": cfg.attn_softcap,
        "logit_softcap": cfg.logit_softcap,
        "rope_local_theta": cfg.rope_local_theta,
    }
    for name, value in gemma_fields.items():
        if value is not None:
            raise ConfigError(f"model.{name}={value} is Gemma's (family gemma2/3)")
    if cfg.global_every:
        raise ConfigError(f"model.global_every={cfg.global_every} is Gemma's (family gemma2/3)")


def family(cfg: ModelConfig) -> str:
    """Which Hugging Face architecture `cfg` is (its `model_type`); ConfigError naming the
    fields if none."""
    if cfg.gemma:
        check_gemma(cfg)
        return cfg.arch
    _gemma_only(cfg)
    llama = (cfg.norm, cfg.mlp, cfg.pos, cfg.bias) == ("rmsnorm", "swiglu", "rope", False)
    gpt2 = (cfg.norm, cfg.mlp, cfg.pos, cfg.bias, cfg.tie_embeddings) == (
        "layernorm", "gelu", "learned", True, True,
    )  # fmt: skip
    if llama and cfg.arch != GPT2 and (cfg.sliding_window is None or cfg.arch == MISTRAL):
        return cfg.arch  # of the Llama-like families only Mistral's attention slides
    if gpt2 and cfg.arch == GPT2:
        return GPT2
    raise ConfigError(
        f"model.family={cfg.arch!r} norm={cfg.norm!r} mlp={cfg.mlp!r} pos={cfg.pos!r} "
        f"bias={cfg.bias} tie_embeddings={cfg.tie_embeddings} "
        f"sliding_window={cfg.sliding_window} is neither Llama-like (rmsnorm, swiglu, rope, "
        "no bias; a sliding window in family mistral only) nor GPT2LMHeadModel (layernorm, "
        "gelu, learned, bias, tied)"
    )


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for `cfg` (the inverse of `from_hf_config`); byte-level: no special tokens."""
    kind = family(cfg)
    common = {
        "architectures": [ARCHITECTURES.get(kind)],  # Gemma's: gemma_fields
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,  # Phi-3's default (32000) would be out of a smaller vocabulary
        "torch_dtype": "float32",
    }
    if cfg.gemma:
        return {**common, **gemma_fields(cfg)}
    if kind == GPT2:
        return {
            **common,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.ffn_dim,
            "n_positions": cfg.max_seq_len,
            "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new",
            **{f"{site}_pdrop": cfg.dropout for site in ("resid", "embd", "attn")},
        }
    window = {"sliding_window": cfg.sliding_window} if kind == MISTRAL else {}
    return {
        **common,
        **window,
        **dict.fromkeys(SWITCHES.get(kind, ()), False),
        **({"use_sliding_window": False} if kind in (QWEN2, QWEN3) else {}),
        "head_dim": cfg.head_dim,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "intermediate_size": cfg.ffn_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        **_rope_scaling(cfg),
        "hidden_act": "silu",
        "attention_dropout": cfg.dropout,
    }


def _rope_scaling(cfg: ModelConfig) -> dict[str, Any]:
    """Llama 3's RoPE rescale as a config.json's `rope_scaling` (nothing for plain RoPE)."""
    if cfg.rope_factor is None:
        return {}
    ours = (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
            cfg.rope_original_max)  # fmt: skip
    spec = dict(zip(LLAMA3_FIELDS.values(), ours, strict=True))
    return {"rope_scaling": {"rope_type": "llama3", **spec}}
