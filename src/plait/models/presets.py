"""Published architectures by name, with parameter counts equal to the published ones.

The table is rebuilt on every call so that no caller can change a preset for others
(no module-level mutable state).
"""

from __future__ import annotations

from typing import Any

from plait.errors import ConfigError
from plait.models.architecture import ModelConfig


def _gpt2(**shape: Any) -> dict[str, Any]:
    """GPT-2 family: LayerNorm, GELU MLP, learned positions, tied embeddings, biases."""
    base = dict(vocab_size=50257, max_seq_len=1024, norm="layernorm", norm_eps=1e-5)
    return {**base, "mlp": "gelu", "pos": "learned", "tie_embeddings": True, "bias": True, **shape}


def _llama(**shape: Any) -> dict[str, Any]:
    """LLaMA family: RMSNorm, SwiGLU, RoPE, untied head, no biases."""
    base = dict(vocab_size=32000, max_seq_len=2048, norm="rmsnorm", norm_eps=1e-6, mlp="swiglu")
    return {
        **base,
        "pos": "rope",
        "rope_theta": 10000.0,
        "tie_embeddings": False,
        "bias": False,
        **shape,
    }


def _mistral(**shape: Any) -> dict[str, Any]:
    """Mistral 7B: LLaMA's block with grouped-query attention (8 kv heads)."""
    mistral = dict(family="mistral", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8)
    return _llama(**mistral, ffn_hidden=14336, max_seq_len=32768, norm_eps=1e-5, **shape)


def _table() -> dict[str, dict[str, Any]]:
    """name -> ModelConfig keyword arguments (fresh dicts each call)."""
    return {
        # GPT-2 (Radford et al., 2019), sizes as released by OpenAI / Hugging Face.
        "gpt2": _gpt2(n_layers=12, d_model=768, n_heads=12),
        "gpt2-medium": _gpt2(n_layers=24, d_model=1024, n_heads=16),
        "gpt2-large": _gpt2(n_layers=36, d_model=1280, n_heads=20),
        "gpt2-xl": _gpt2(n_layers=48, d_model=1600, n_heads=25),
        # LLaMA (Touvron et al., 2023): ffn from the 8h/3 rule rounded up to 256.
        "llama-7b": _llama(n_layers=32, d_model=4096, n_heads=32),
        "llama-13b": _llama(n_layers=40, d_model=5120, n_heads=40),
        "llama-30b": _llama(n_layers=60, d_model=6656, n_heads=52),
        "llama-65b": _llama(n_layers=80, d_model=8192, n_heads=64),
        # Llama 2 70B: grouped-query attention; ffn given explicitly (the rule with
        # ffn_dim_multiplier=1.3 and multiple_of=4096 gives 28672).
        "llama2-70b": _llama(
            n_layers=80,
            d_model=8192,
            n_heads=64,
            n_kv_heads=8,
            ffn_hidden=28672,
            max_seq_len=4096,
            norm_eps=1e-5,
        ),
        "llama3-8b": _llama(
            vocab_size=128256,
            n_layers=32,
            d_model=4096,
            n_heads=32,
            n_kv_heads=8,
            ffn_hidden=14336,
            rope_theta=500000.0,
            max_seq_len=8192,
            norm_eps=1e-5,
        ),
        # Mistral 7B (Jiang et al., 2023): v0.1 slides a 4,096-position window in every
        # layer; v0.3 attends to all, with a 32,768 vocabulary and RoPE base 1e6.
        "mistral-7b-v0.1": _mistral(sliding_window=4096),
        "mistral-7b-v0.3": _mistral(vocab_size=32768, rope_theta=1e6),
        # Small byte-level models (vocabulary 256) for tests and CPU runs.
        "tiny-gpt": _gpt2(vocab_size=256, n_layers=2, d_model=64, n_heads=4, max_seq_len=64),
        "tiny-llama": _llama(
            vocab_size=256,
            n_layers=2,
            d_model=64,
            n_heads=4,
            n_kv_heads=2,
            ffn_hidden=128,
            max_seq_len=64,
        ),
        # Mistral's sliding window (6) shorter than the test rows, and a head size (32) not
        # d_model / heads (Mistral Nemo's shape).
        "tiny-mistral": _llama(
            family="mistral",
            vocab_size=256,
            n_layers=2,
            d_model=64,
            n_heads=4,
            n_kv_heads=2,
            head_size=32,
            ffn_hidden=128,
            max_seq_len=64,
            sliding_window=6,
        ),
        "small-gpt": _gpt2(vocab_size=256, n_layers=4, d_model=128, n_heads=4, max_seq_len=256),
        "small-llama": _llama(
            vocab_size=256, n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, max_seq_len=256
        ),
    }


def preset_names() -> list[str]:
    """Names accepted by get_preset, in table order."""
    return list(_table())


def get_preset(name: str) -> ModelConfig:
    """A new ModelConfig for the named architecture; ConfigError listing names if unknown."""
    table = _table()
    if name not in table:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {', '.join(table)}")
    return ModelConfig(**table[name])
