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


def _gemma(family: str, **shape: Any) -> dict[str, Any]:
    """Gemma 2 and 3: LLaMA's Linears with a tanh-GELU gate, (1 + w) norms before and after
    each sublayer, tied embeddings, head size 256 and scores over sqrt(256) unless given."""
    gemma = dict(family=family, mlp="geglu", tie_embeddings=True, head_size=256, attn_scalar=256.0)
    return _llama(**{**gemma, **shape})


def _llama3(factor: float, **shape: Any) -> dict[str, Any]:
    """Llama 3.1/3.2: 128,256-token vocabulary, RoPE base 500000 rescaled by `factor` (the
    llama3 rope_type, original context 8192), 131,072 positions."""
    rope = dict(rope_theta=500000.0, rope_factor=factor, rope_low_freq_factor=1.0,
                rope_high_freq_factor=4.0, rope_original_max=8192)  # fmt: skip
    return _llama(vocab_size=128256, max_seq_len=131072, norm_eps=1e-5, **rope, **shape)


def _qwen(family: str, **shape: Any) -> dict[str, Any]:
    """Qwen2.5 (biases on q, k, v) and Qwen3 (per-head q/k norms): RoPE base 1e6."""
    base = dict(family=family, rope_theta=1e6, norm_eps=1e-6, max_seq_len=32768)
    return _llama(**(base | shape))


def _families() -> dict[str, dict[str, Any]]:
    """The Llama-like families as Hugging Face publishes them (config.json of each)."""
    return {
        "llama3.2-1b": _llama3(32.0, n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8,
                               ffn_hidden=8192, tie_embeddings=True),
        "llama3.2-3b": _llama3(32.0, n_layers=28, d_model=3072, n_heads=24, n_kv_heads=8,
                               ffn_hidden=8192, tie_embeddings=True),
        "llama3.1-8b": _llama3(8.0, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
                               ffn_hidden=14336),
        "llama3.1-70b": _llama3(8.0, n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8,
                                ffn_hidden=28672),
        "qwen2.5-0.5b": _qwen("qwen2", vocab_size=151936, n_layers=24, d_model=896, n_heads=14,
                              n_kv_heads=2, ffn_hidden=4864, tie_embeddings=True),
        "qwen2.5-7b": _qwen("qwen2", vocab_size=152064, n_layers=28, d_model=3584, n_heads=28,
                            n_kv_heads=4, ffn_hidden=18944),
        "qwen3-0.6b": _qwen("qwen3", vocab_size=151936, n_layers=28, d_model=1024, n_heads=16,
                            n_kv_heads=8, head_size=128, ffn_hidden=3072, tie_embeddings=True,
                            max_seq_len=40960),
        "phi3-mini": _llama(family="phi3", vocab_size=32064, n_layers=32, d_model=3072,
                            n_heads=32, ffn_hidden=8192, max_seq_len=4096, norm_eps=1e-5),
    }  # fmt: skip


def _tiny(family: str, **over: Any) -> dict[str, Any]:
    """A byte-level model of `family` for tests and CPU runs, with every flag it has."""
    shape = dict(vocab_size=256, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                 ffn_hidden=128, max_seq_len=64, family=family)  # fmt: skip
    return _llama(**(shape | over))


def _tiny_families() -> dict[str, dict[str, Any]]:
    """Tiny models of each Llama-like family (Llama 3's rescale within a 16-token context,
    Qwen3's head size apart from d_model / n_heads)."""
    return {
        "tiny-llama3": _tiny("llama", rope_theta=500000.0, rope_factor=8.0,
                             rope_original_max=16, tie_embeddings=True),
        "tiny-qwen2": _tiny("qwen2", rope_theta=1e6, tie_embeddings=True),
        "tiny-qwen3": _tiny("qwen3", head_size=24, tie_embeddings=True),
        "tiny-phi3": _tiny("phi3"),
    }  # fmt: skip


def _windowed_families() -> dict[str, dict[str, Any]]:
    """The families whose attention slides, as published (config.json of each)."""
    return {
        # Mistral 7B (Jiang et al., 2023): v0.1 slides a 4,096-position window in every
        # layer; v0.3 attends to all, with a 32,768 vocabulary and RoPE base 1e6.
        "mistral-7b-v0.1": _mistral(sliding_window=4096),
        "mistral-7b-v0.3": _mistral(vocab_size=32768, rope_theta=1e6),
        # Gemma 2 2B (Gemma Team, 2024): a 4,096 window on every other layer, soft-capped
        # scores (50) and logits (30). Gemma 3 1B (2025): a 512 window on five layers of
        # six, their RoPE base 10,000, the global layers' 1,000,000; q/k norms, no caps.
        "gemma2-2b": _gemma("gemma2", vocab_size=256000, n_layers=26, d_model=2304, n_heads=8,
                            n_kv_heads=4, ffn_hidden=9216, max_seq_len=8192,
                            sliding_window=4096, global_every=2, attn_softcap=50.0,
                            logit_softcap=30.0),
        "gemma3-1b": _gemma("gemma3", vocab_size=262144, n_layers=26, d_model=1152, n_heads=4,
                            n_kv_heads=1, ffn_hidden=6912, max_seq_len=32768,
                            sliding_window=512, global_every=6, rope_theta=1e6,
                            rope_local_theta=10000.0),
    }  # fmt: skip


def _tiny_windowed() -> dict[str, dict[str, Any]]:
    """Tiny models of the sliding families: windows (6) shorter than the test rows, head
    sizes apart from d_model / n_heads; Gemma 2 with both soft-caps, Gemma 3 with two RoPE
    bases."""
    gemma = dict(head_size=24, attn_scalar=20.0, sliding_window=6, mlp="geglu", tie_embeddings=True)
    return {
        "tiny-mistral": _tiny("mistral", head_size=32, sliding_window=6),
        "tiny-gemma2": _tiny("gemma2", **gemma, global_every=2, attn_softcap=2.0,
                             logit_softcap=3.0),
        "tiny-gemma3": _tiny("gemma3", **gemma, n_layers=3, global_every=3,
                             rope_theta=5000.0, rope_local_theta=100.0),
    }  # fmt: skip


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
        **_families(),
        **_windowed_families(),
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
        **_tiny_families(),
        **_tiny_windowed(),
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
