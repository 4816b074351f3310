"""Keyed dropout: masks are pure functions of (sample key, site, global element index)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from plait.models.dropout import MASK32, KeyedDropout, hash32, keep_mask, sample_keys
from plait.models.init import init_parameters
from plait.models.presets import get_preset
from plait.models.transformer import Transformer


def lowbias32(x: int) -> int:
    """Reference in plain Python integers."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def test_hash32_matches_reference_and_stays_in_range() -> None:
    values = [0, 1, 2, 12345, MASK32 - 1, MASK32]
    values += torch.randint(0, 2**32, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    out = hash32(torch.tensor(values))
    assert out.tolist() == [lowbias32(v) for v in values]
    assert out.min() >= 0 and out.max() <= MASK32
    with pytest.raises(TypeError):
        hash32(torch.tensor([1], dtype=torch.int32))


def test_sample_keys() -> None:
    pos = torch.arange(8)
    keys = sample_keys(1, 5, pos)
    assert keys.dtype == torch.int64 and keys.shape == (8,)
    assert keys.min() >= 0 and keys.max() <= MASK32
    assert torch.equal(keys, sample_keys(1, 5, pos))
    assert torch.equal(keys[3:5], sample_keys(1, 5, pos[3:5]))  # independent of the shard
    assert len(set(keys.tolist())) == 8
    assert not torch.equal(keys, sample_keys(1, 6, pos))
    assert not torch.equal(keys, sample_keys(2, 5, pos))
    assert not torch.equal(keys, sample_keys(1 + 2**32, 5, pos))  # high seed bits count


def test_mask_deterministic_and_per_sample() -> None:
    keys = sample_keys(0, 0, torch.arange(4))
    m = keep_mask(keys, 3, (5, 7), 0.3)
    assert m.shape == (4, 5, 7) and m.dtype == torch.bool
    assert torch.equal(m, keep_mask(keys.clone(), 3, (5, 7), 0.3))
    # A sample's mask does not depend on its neighbours in the batch.
    assert torch.equal(m[2:3], keep_mask(keys[2:3], 3, (5, 7), 0.3))
    assert torch.equal(m[[3, 0]], keep_mask(keys[[3, 0]], 3, (5, 7), 0.3))


def test_slice_of_global_mask_equals_local_mask() -> None:
    keys = sample_keys(11, 2, torch.arange(3))
    full = keep_mask(keys, 9, (4, 10, 6), 0.5)
    # Shards on two dims at once (e.g. heads for TP and sequence for SP).
    for off in [(0, 0, 0), (2, 3, 0), (1, 7, 2), (3, 0, 4)]:
        local = (1, 3, 2)
        got = keep_mask(keys, 9, local, 0.5, global_shape=(4, 10, 6), offsets=off)
        want = full[:, off[0] : off[0] + 1, off[1] : off[1] + 3, off[2] : off[2] + 2]
        assert torch.equal(got, want), off
    with pytest.raises(ValueError, match="outside the global size"):
        keep_mask(keys, 9, (2, 3, 2), 0.5, global_shape=(4, 10, 6), offsets=(3, 0, 0))


def test_keep_rate() -> None:
    keys = sample_keys(0, 0, torch.arange(4))
    for p in (0.1, 0.5, 0.9):
        rate = keep_mask(keys, 0, (256, 256), p).float().mean().item()
        assert abs(rate - (1 - p)) < 0.005, (p, rate)
    assert keep_mask(keys, 0, (64,), 0.0).all()


def test_different_keys_and_sites_differ() -> None:
    keys = sample_keys(0, 0, torch.arange(2))
    a = keep_mask(keys, 1, (64, 64), 0.5)
    b = keep_mask(keys, 2, (64, 64), 0.5)
    assert not torch.equal(a[0], a[1])  # different samples
    # Independent-looking masks agree on about half the elements.
    assert abs((a == b).float().mean().item() - 0.5) < 0.03
    assert abs((a[0] == a[1]).float().mean().item() - 0.5) < 0.03


def test_keyed_dropout_module() -> None:
    drop = KeyedDropout(0.25, site=5)
    x = torch.randn(3, 8, 16)
    keys = sample_keys(0, 0, torch.arange(3))
    y = drop(x, keys)
    mask = keep_mask(keys, 5, (8, 16), 0.25)
    torch.testing.assert_close(y, x * mask / 0.75)
    torch.testing.assert_close(y[mask], x[mask] / 0.75)
    assert (y[~mask] == 0).all()
    drop.eval()
    assert drop(x, keys) is x
    assert KeyedDropout(0.0, 0)(x, None) is x


def test_unkeyed_dropout_replays_under_checkpoint() -> None:
    drop = KeyedDropout(0.5, site=0)
    x = torch.randn(4, 32, requires_grad=True)
    torch.manual_seed(0)
    out = checkpoint(lambda t: drop(t, None) * 1.0, x, use_reentrant=False)
    out.sum().backward()
    # Recomputation reused the same keys: the gradient mask is the forward mask.
    torch.testing.assert_close(x.grad, (out != 0).float() * 2.0)


def test_model_with_dropout_depends_only_on_keys() -> None:
    cfg = dataclasses.replace(get_preset("tiny-llama"), dropout=0.1)
    model = Transformer(cfg)
    init_parameters(model, 0)
    model.train()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    keys = sample_keys(0, 0, torch.arange(2))
    a, b = model(x, x, keys), model(x, x, keys.clone())
    assert a.item() == b.item()
    c = model(x, x, sample_keys(0, 1, torch.arange(2)))
    assert c.item() != a.item()
    model.eval()
    assert model(x, x, keys).item() != a.item()
    # Per-sample: the first sample's logits do not depend on the second sample.
    model.train()
    full = model(x, keys=keys)
    torch.testing.assert_close(model(x[:1], keys=keys[:1]), full[:1])


def test_indices_beyond_32_bits() -> None:
    # A per-sample tensor of 70000 x 70000 elements (> 2^32) needs the high index word.
    keys = sample_keys(0, 0, torch.arange(2))
    g = (70_000, 70_000)
    a = keep_mask(keys, 1, (10, 10), 0.5, global_shape=g, offsets=(69_990, 69_990))
    b = keep_mask(keys, 1, (3, 4), 0.5, global_shape=g, offsets=(69_995, 69_993))
    assert torch.equal(a[:, 5:8, 3:7], b)
    assert 0.2 < a.float().mean().item() < 0.8
