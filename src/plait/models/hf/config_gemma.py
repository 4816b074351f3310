"""Gemma 2 and Gemma 3 (text) config.json <-> ModelConfig, refusing what plait cannot express.

Both are LLaMA's Linears with a tanh-GELU gate, four (1 + w) norms per block, embeddings
times sqrt(d), a head size of their own and query_pre_attn_scalar; layers alternate between
a sliding window and global attention by `layer_types` (plait: every `global_every`-th layer
global, the pattern both write). Gemma 2 soft-caps attention scores and the final logits;
Gemma 3 does neither, norms q and k per head, and takes a RoPE base per layer kind
(`rope_parameters.sliding_attention` / `full_attention`). Imports nothing of config_json
(which dispatches here), so its refusals are spelled the same way here.
"""

from __future__ import annotations

from typing import Any

from plait.errors import ConfigError
from plait.models.architecture import ModelConfig

GEMMA_TYPES = {"gemma2": "gemma2", "gemma3_text": "gemma3"}  # model_type -> model.family
GEMMA_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
GELU_TANH = "gelu_pytorch_tanh"
SLIDING, FULL = "sliding_attention", "full_attention"


def _refuse(where: str, field: str, value: Any, need: str) -> None:
    raise ConfigError(f"{where}: {field}={value!r} cannot be expressed by plait's model ({need})")


def global_every(types: list[str], where: str) -> int:
    """n where layer i is global exactly when (i + 1) % n == 0 (0: none is), or a refusal
    naming the layer_types that follow no such pattern."""
    full = [i for i, kind in enumerate(types) if kind == FULL]
    n = full[0] + 1 if full else 0
    expected = [FULL if n and (i + 1) % n == 0 else SLIDING for i in range(len(types))]
    if types != expected:
        _refuse(where, "layer_types", types, "every n-th layer global, the others sliding")
    return n


def _rope(hf: dict[str, Any], where: str, gemma3: bool) -> tuple[float, float | None]:
    """(global base, local base or None): Gemma 2's one `rope_parameters`, Gemma 3's one per
    layer kind (transformers' defaults 1e6 and 1e4)."""
    params = hf.get("rope_parameters") or {}
    spec = {FULL: params.get(FULL) or {}, SLIDING: params.get(SLIDING) or {}} if gemma3 else {}
    for name, one in (spec or {"": params}).items():
        kind = one.get("rope_type", "default")
        if kind != "default":
            _refuse(where, f"rope_parameters{'.' + name if name else ''}.rope_type", kind,
                    "plain RoPE only")  # fmt: skip
    if not gemma3:
        return float(params.get("rope_theta", hf.get("rope_theta", 10000.0))), None
    full = float(spec[FULL].get("rope_theta", hf.get("rope_theta", 1e6)))
    return full, float(spec[SLIDING].get("rope_theta", hf.get("rope_local_base_freq", 1e4)))


def gemma_config(hf: dict[str, Any], where: str, model_type: str) -> ModelConfig:
    """The ModelConfig of a Gemma 2 or Gemma 3 text config.json."""
    family = GEMMA_TYPES[model_type]
    gemma3 = family == "gemma3"
    act = hf.get("hidden_activation", hf.get("hidden_act", GELU_TANH))
    if act != GELU_TANH:
        _refuse(where, "hidden_activation", act, f"needs {GELU_TANH!r}")
    for field in ("attention_bias", "use_bidirectional_attention"):
        if hf.get(field):
            _refuse(where, field, hf[field], "needs False")
    window = hf.get("sliding_window", 4096)
    types = hf.get("layer_types") or [
        SLIDING if (i + 1) % (6 if gemma3 else 2) else FULL for i in range(hf["num_hidden_layers"])
    ]
    theta, local = _rope(hf, where, gemma3)
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim", 256)
    default_cap = None if gemma3 else (50.0, 30.0)
    caps = (hf.get("attn_logit_softcapping", default_cap and default_cap[0]),
            hf.get("final_logit_softcapping", default_cap and default_cap[1]))  # fmt: skip
    return ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        n_layers=hf["num_hidden_layers"],
        d_model=d,
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_size=None if head_dim * heads == d else head_dim,
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 8192),
        norm="rmsnorm",
        mlp="geglu",
        pos="rope",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        bias=False,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_local_theta=local if window is not None else None,
        sliding_window=window if SLIDING in types else None,
        global_every=global_every(types, where) if window is not None else 0,
        attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_softcap=None if caps[0] is None else float(caps[0]),
        logit_softcap=None if caps[1] is None else float(caps[1]),
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def check_gemma(cfg: ModelConfig) -> None:
    """A Gemma family config that a Gemma folder can hold, or ConfigError naming the values."""
    shape = (cfg.norm, cfg.mlp, cfg.pos, cfg.bias)
    if shape != ("rmsnorm", "geglu", "rope", False):
        raise ConfigError(
            f"model.family={cfg.arch!r} norm={cfg.norm!r} mlp={cfg.mlp!r} pos={cfg.pos!r} "
            f"bias={cfg.bias} is not Gemma's (rmsnorm, geglu, rope, no bias)"
        )
    if cfg.arch == "gemma3" and (cfg.attn_softcap or cfg.logit_softcap):
        raise ConfigError("Gemma 3 soft-caps nothing: model.attn_softcap and logit_softcap unset")


def gemma_fields(cfg: ModelConfig) -> dict[str, Any]:
    """config.json fields of a Gemma model (the inverse of `gemma_config`)."""
    gemma3 = cfg.arch == "gemma3"
    types = [SLIDING if cfg.window(i) is not None else FULL for i in range(cfg.n_layers)]
    if gemma3:
        local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
        rope = {FULL: {"rope_type": "default", "rope_theta": cfg.rope_theta},
                SLIDING: {"rope_type": "default", "rope_theta": local}}  # fmt: skip
    else:
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "architectures": [GEMMA_ARCHITECTURES[cfg.arch]],
        "model_type": "gemma3_text" if gemma3 else "gemma2",
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope,
        "hidden_activation": GELU_TANH,
        "attention_bias": False,
        "attention_dropout": cfg.dropout,
        "query_pre_attn_scalar": _whole(cfg.attn_scalar or cfg.head_dim),
        "sliding_window": cfg.sliding_window,
        "layer_types": types,
        "attn_logit_softcapping": cfg.attn_softcap,
        "final_logit_softcapping": cfg.logit_softcap,
        "pad_token_id": None,
    }


def _whole(x: float) -> int | float:
    """An integral value as an int (transformers' query_pre_attn_scalar is typed int)."""
    return int(x) if float(x).is_integer() else x
