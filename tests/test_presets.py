"""Presets: published parameter counts, exactly, computed on the meta device."""

from __future__ import annotations

import pytest
import torch

from plait.errors import ConfigError
from plait.models.presets import get_preset, preset_names
from plait.models.transformer import (
    Transformer,
    count_parameters,
    linear_weight_elements,
    matmul_flops_per_token,
)

PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "llama-30b": 32_528_943_616,
    "llama-65b": 65_285_660_672,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "phi3-mini": 3_821_079_552,
}
FAMILIES = ["llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b", "qwen2.5-0.5b",
            "qwen2.5-7b", "qwen3-0.6b", "phi3-mini"]  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_count(name: str) -> None:
    assert count_parameters(get_preset(name)) == PUBLISHED[name]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_presets_count_what_transformers_builds(name: str) -> None:
    """The preset's config.json (as `plait export` writes it) built by transformers on the
    meta device has the preset's parameters, a tied head counted once."""
    transformers = pytest.importorskip("transformers")
    from plait.models.hf.config_json import hf_config

    config = transformers.AutoConfig.for_model(**hf_config(get_preset(name)))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]


def test_counting_allocates_nothing() -> None:
    # The same construction count_parameters uses: every tensor must be on meta.
    cfg = get_preset("llama-65b")
    with torch.device("meta"):
        model = Transformer(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED["llama-65b"]


def test_all_presets_valid_and_buildable_names() -> None:
    names = preset_names()
    assert set(PUBLISHED) <= set(names)
    assert {"tiny-gpt", "tiny-llama", "small-gpt", "small-llama"} <= set(names)
    for name in names:
        get_preset(name).validate()


def test_small_presets_shapes() -> None:
    tiny = get_preset("tiny-llama")
    assert (tiny.vocab_size, tiny.n_layers, tiny.d_model, tiny.kv_heads, tiny.ffn_dim) == (
        256,
        2,
        64,
        2,
        128,
    )
    assert get_preset("small-gpt").max_seq_len == 256


def test_preset_details() -> None:
    l3 = get_preset("llama3-8b")
    assert (l3.rope_theta, l3.kv_heads, l3.norm_eps, l3.max_seq_len) == (500000.0, 8, 1e-5, 8192)
    l1 = get_preset("llama-30b")
    assert (l1.ffn_dim, l1.head_dim, l1.norm_eps, l1.tie_embeddings) == (17920, 128, 1e-6, False)
    g = get_preset("gpt2-xl")
    assert (g.head_dim, g.tie_embeddings, g.bias, g.pos) == (64, True, True, "learned")


def test_unknown_preset_names_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        get_preset("gpt5")
    msg = str(err.value)
    assert "'gpt5'" in msg
    for name in preset_names():
        assert name in msg


def test_get_preset_returns_independent_copies() -> None:
    a = get_preset("gpt2")
    a.n_layers = 1
    a.vocab_size = 7
    b = get_preset("gpt2")
    assert (b.n_layers, b.vocab_size) == (12, 50257)
    assert get_preset("gpt2") is not get_preset("gpt2")


def test_flops_formula() -> None:
    cfg = get_preset("gpt2")
    with torch.device("meta"):
        model = Transformer(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear_weight_elements(cfg) == linear
    assert matmul_flops_per_token(cfg, 1024) == 6 * linear + 12 * 12 * 1024 * 768
    # llama-7b: everything except the input embedding is a Linear weight.
    l7 = get_preset("llama-7b")
    norms = (2 * 32 + 1) * 4096
    assert linear_weight_elements(l7) == PUBLISHED["llama-7b"] - 32000 * 4096 - norms
