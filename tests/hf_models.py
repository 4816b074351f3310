"""Tiny Hugging Face models for the interchange tests, built from configs (random weights,
saved locally, nothing downloaded). `transformers` is imported inside the functions so that
the spawned workers of a multi-rank test, which import this module, never pay for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def llama_config(vocab: int = 300, **over: Any):
    from transformers import LlamaConfig

    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 rms_norm_eps=1e-5, rope_theta=5000.0)  # fmt: skip
    return LlamaConfig(**(shape | over))


def qwen3_config(vocab: int = 300, **over: Any):
    """Qwen3 with every flag: per-head q/k norms, a head size that is not hidden / heads
    (3 x 24 = 72 wide q over hidden 64), grouped-query attention, tied head."""
    from transformers import Qwen3Config

    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                 max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e6,
                 tie_word_embeddings=True)  # fmt: skip
    return Qwen3Config(**(shape | over))


def qwen2_config(vocab: int = 300, **over: Any):
    """Qwen2 with every flag: biases on q, k and v (not o), tied head, RoPE base 1e6."""
    from transformers import Qwen2Config

    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)  # fmt: skip
    return Qwen2Config(**(shape | over))


def llama3_config(vocab: int = 300, **over: Any):
    """Llama 3.2 with every flag: the llama3 RoPE rescale (an original context of 16 puts
    the tiny head's wavelengths on both sides of the blend), base 500000, tied head."""
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)  # fmt: skip
    return llama_config(vocab, rope_theta=500000.0, rope_scaling=scaling,
                        tie_word_embeddings=True, **over)  # fmt: skip


def phi3_config(vocab: int = 300, **over: Any):
    """Phi-3-mini with every flag: fused qkv_proj and gate_up_proj, untied head."""
    from transformers import Phi3Config

    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 original_max_position_embeddings=64, rms_norm_eps=1e-5, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2, sliding_window=None)  # fmt: skip
    return Phi3Config(**(shape | over))


FAMILY_CONFIGS = {
    "llama3": llama3_config,
    "qwen2": qwen2_config,
    "qwen3": qwen3_config,
    "phi3": phi3_config,
}
"""Each family's tiny config with every one of its flags set (tests/test_hf_families.py)."""


def gpt2_config(vocab: int = 300, **over: Any):
    from transformers import GPT2Config

    shape = dict(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return GPT2Config(**(shape | over))


def save(config, folder: Path, seed: int = 0, **kw: Any) -> Path:
    """A model of `config` with seeded random weights, saved as a Hugging Face folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder, **kw)
    return folder


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def mistral_config(vocab: int = 300, **over: Any):
    """Every Mistral flag set: a sliding window (5) shorter than the test rows, and a head size
    (32) not hidden / heads, as Mistral Nemo and Ministral have."""
    from transformers import MistralConfig

    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 rms_norm_eps=1e-5, rope_theta=5000.0, sliding_window=5,
                 head_dim=32)  # fmt: skip
    return MistralConfig(**(shape | over))


def gemma2_config(vocab: int = 300, **over: Any):
    """Every Gemma 2 flag set: soft-caps (scores 50 -> 2, logits 30 -> 3, so both bite), a
    query_pre_attn_scalar (20) not the head size, a head size (24) not hidden / heads, a
    sliding window (5) on alternate layers, tied embeddings; weights of std 0.3, so that
    scores and logits reach the caps."""
    from transformers import Gemma2Config

    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                 max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
                 sliding_window=5, query_pre_attn_scalar=20, attn_logit_softcapping=2.0,
                 final_logit_softcapping=3.0, pad_token_id=0,
                 initializer_range=0.3)  # fmt: skip
    return Gemma2Config(**(shape | over))


def gemma3_config(vocab: int = 300, **over: Any):
    """Every Gemma 3 flag set: q/k norms, two RoPE bases (local 100, global 5000), a sliding
    window (5) on two layers of three, a head size (24) not hidden / heads."""
    from transformers import Gemma3TextConfig

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 5000.0}}  # fmt: skip
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                 max_position_embeddings=64, rms_norm_eps=1e-5, rope_parameters=rope,
                 sliding_window=5, query_pre_attn_scalar=20, pad_token_id=0,
                 sliding_window_pattern=3)  # fmt: skip
    return Gemma3TextConfig(**(shape | over))


WINDOWED_CONFIGS = {"mistral": mistral_config, "gemma2": gemma2_config, "gemma3": gemma3_config}
"""The families whose attention slides (tests/test_windowed_families.py)."""
