"""The transformer: shapes, loss, causality, tying, GQA, RoPE, init, validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from plait.errors import ConfigError
from plait.models.architecture import ModelConfig
from plait.models.init import init_parameters, init_value
from plait.models.presets import get_preset
from plait.models.transformer import (
    Attention,
    CoreAttention,
    Transformer,
    apply_rope,
    rope_cos_sin,
)

PRESETS = ["tiny-gpt", "tiny-llama"]


def build(name: str, seed: int = 0, **overrides: object) -> Transformer:
    cfg = dataclasses.replace(get_preset(name), **overrides)
    model = Transformer(cfg)
    init_parameters(model, seed)
    return model


def tokens(b: int = 2, s: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", PRESETS)
def test_forward_shapes_and_loss(name: str) -> None:
    model = build(name)
    x, y = tokens(), tokens(seed=1)
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    loss = model(x, y)
    assert loss.shape == ()
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)))
    # Freshly initialized: loss near log(V).
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


@pytest.mark.parametrize("name", PRESETS)
def test_causal(name: str) -> None:
    model = build(name)
    x = tokens(1, 20)
    x2 = x.clone()
    x2[0, 12:] = (x2[0, 12:] + 1) % 256
    a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_submodule_structure() -> None:
    gpt, llama = build("tiny-gpt"), build("tiny-llama")
    assert hasattr(gpt.embed, "pos") and not hasattr(llama.embed, "pos")
    assert {n for n, _ in gpt.blocks[0].mlp.named_children()} == {"fc1", "fc2"}
    assert {n for n, _ in llama.blocks[0].mlp.named_children()} == {"w_gate", "w_up", "w_down"}
    assert isinstance(gpt.blocks[0].attn_norm, torch.nn.LayerNorm)
    assert gpt.blocks[0].attn.wq.bias is not None and llama.blocks[0].attn.wq.bias is None
    assert llama.blocks[0].attn.wk.weight.shape == (2 * 16, 64)
    assert list(llama.blocks[0].attn.core.parameters()) == []
    sites = [m.site for m in gpt.modules() if hasattr(m, "site")]
    assert len(sites) == len(set(sites)) == 1 + 3 * 2


def test_tied_weights_are_one_parameter() -> None:
    gpt = build("tiny-gpt")
    assert gpt.head.weight is gpt.embed.tok.weight
    n_unique = sum(p.numel() for p in gpt.parameters())
    assert n_unique == sum(p.numel() for n, p in gpt.named_parameters() if n != "head.weight")
    llama = build("tiny-llama")
    assert llama.head.weight is not llama.embed.tok.weight


@pytest.mark.parametrize("name", PRESETS)
def test_meta_build_then_init_matches_cpu(name: str) -> None:
    ref = build(name, seed=3)
    with torch.device("meta"):
        model = Transformer(get_preset(name))
    model.to_empty(device="cpu")  # unties shared weights; init_parameters re-ties them
    init_parameters(model, 3)
    assert (model.head.weight is model.embed.tok.weight) == ref.cfg.tie_embeddings
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert n1 == n2
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    cfg = get_preset("tiny-llama")  # 4 query heads, 2 kv heads, head_dim 16
    mha_cfg = dataclasses.replace(cfg, n_kv_heads=4)
    torch.manual_seed(0)
    gqa, mha = Attention(cfg, 0), Attention(mha_cfg, 0)
    with torch.no_grad():
        for name in ("wq", "wo"):
            getattr(mha, name).weight.copy_(getattr(gqa, name).weight)
        for name in ("wk", "wv"):
            w = getattr(gqa, name).weight.view(2, 16, 64)  # (kv, hd, h)
            # kv head j serves query heads 2j and 2j+1.
            getattr(mha, name).weight.copy_(w.repeat_interleave(2, dim=0).reshape(64, 64))
    x = torch.randn(2, 10, 64)
    torch.testing.assert_close(gqa(x, None), mha(x, None))


def test_rope_preserves_norm_and_is_relative() -> None:
    hd, s = 16, 12
    cos, sin = rope_cos_sin(s, hd, 10000.0, torch.device("cpu"))
    x = torch.randn(1, 1, s, hd)
    rx = apply_rope(x, cos, sin)
    torch.testing.assert_close(rx.norm(dim=-1), x.norm(dim=-1))
    q, k = torch.randn(hd), torch.randn(hd)
    rq = apply_rope(q.expand(1, 1, s, hd), cos, sin)[0, 0]  # q at every position
    rk = apply_rope(k.expand(1, 1, s, hd), cos, sin)[0, 0]
    # <R_m q, R_n k> depends only on m - n.
    torch.testing.assert_close(rq[5] @ rk[2], rq[9] @ rk[6])
    torch.testing.assert_close(rq[3] @ rk[3], q @ k)
    assert not torch.allclose(rq[5] @ rk[2], rq[5] @ rk[3])


def test_rope_on_meta_device() -> None:
    with torch.device("meta"):
        model = Transformer(get_preset("tiny-llama"))
        out = model(torch.zeros(2, 8, dtype=torch.long))
    assert out.is_meta and out.shape == (2, 8, 256)


def test_init_value_deterministic_and_independent() -> None:
    cfg = get_preset("tiny-gpt")
    name, shape = "blocks.1.attn.wq.weight", (64, 64)
    a = init_value(cfg, name, shape, seed=7)
    init_value(cfg, "blocks.0.attn.wq.weight", shape, seed=7)  # other draws in between
    torch.testing.assert_close(init_value(cfg, name, shape, seed=7), a, rtol=0, atol=0)
    assert not torch.equal(init_value(cfg, name, shape, seed=8), a)
    assert not torch.equal(init_value(cfg, "blocks.0.attn.wq.weight", shape, seed=7), a)
    # A model holding other parameters (more layers) gets the same value for this name.
    big = build("tiny-gpt", seed=7, n_layers=3)
    small = build("tiny-gpt", seed=7)
    torch.testing.assert_close(big.blocks[1].attn.wq.weight, a, rtol=0, atol=0)
    torch.testing.assert_close(small.blocks[1].attn.wq.weight, a, rtol=0, atol=0)
    # Wrapper prefixes do not change the value.
    wrapped = init_value(cfg, "module._orig_mod.blocks.1.attn.wq.weight", shape, seed=7)
    torch.testing.assert_close(wrapped, a, rtol=0, atol=0)


def test_init_value_kinds_and_residual_scaling() -> None:
    cfg = get_preset("tiny-gpt")  # 2 layers: residual std 0.02 / 2
    assert torch.equal(init_value(cfg, "blocks.0.attn.wq.bias", (64,), 0), torch.zeros(64))
    assert torch.equal(init_value(cfg, "blocks.0.mlp_norm.weight", (64,), 0), torch.ones(64))
    assert torch.equal(init_value(cfg, "norm.weight", (64,), 0), torch.ones(64))
    shape = (512, 512)
    std_q = init_value(cfg, "blocks.0.attn.wq.weight", shape, 0).std().item()
    assert abs(std_q - 0.02) < 0.02 * 0.02
    llama = get_preset("tiny-llama")  # 2 layers too; the residual rows are its table's
    for c, name in (
        (cfg, "blocks.0.attn.wo.weight"),
        (cfg, "blocks.1.mlp.fc2.weight"),
        (llama, "blocks.0.mlp.w_down.weight"),
    ):
        std = init_value(c, name, shape, 0).std().item()
        assert abs(std - 0.01) < 0.01 * 0.02, name
    for mystery in ("blocks.0.mystery.weight", "blocks.0.mlp.w_down.weight"):  # not GPT-2's
        with pytest.raises(ValueError, match=mystery):
            init_value(cfg, mystery, shape, 0)


def test_model_validation_messages() -> None:
    with pytest.raises(ConfigError, match=r"d_model=100 is not divisible by model.n_heads=3"):
        ModelConfig(d_model=100, n_heads=3).validate()
    with pytest.raises(ConfigError, match=r"n_heads=4 is not divisible by model.n_kv_heads=3"):
        Transformer(ModelConfig(d_model=64, n_heads=4, n_kv_heads=3))
    with pytest.raises(ConfigError, match="even head dimension, got 3"):
        Transformer(ModelConfig(d_model=12, n_heads=4, pos="rope"))
    with pytest.raises(ConfigError, match=r"model.family='mamba' is not one plait builds \(llama"):
        ModelConfig(family="mamba").validate()
    with pytest.raises(ConfigError, match=r"model.family='llama' has a swiglu MLP, got model.mlp="):
        ModelConfig(family="llama", mlp="gelu").validate()


def test_sequence_longer_than_learned_positions() -> None:
    model = build("tiny-gpt")
    with pytest.raises(ValueError, match="exceeds max_seq_len 64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_explicit_attention_path_matches_fused() -> None:
    # With p tiny enough that nothing is dropped, the keyed explicit path (used whenever
    # dropout is active) must compute the same attention as scaled_dot_product_attention.
    core = CoreAttention(1e-12, site=1).train()
    q, k, v = (torch.randn(2, 4, 9, 16) for _ in range(3))
    keys = torch.arange(2)
    torch.testing.assert_close(core(q, k, v, keys), core.eval()(q, k, v, keys))
