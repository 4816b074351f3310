"""Recomputation re-runs exactly the intended modules and keeps fewer activations."""

from __future__ import annotations

import pytest
import torch

from plait.build.model import build_model
from plait.errors import ConfigError
from plait.models.dropout import sample_keys
from plait.models.presets import get_preset
from plait.parallel.activation_recompute import apply_recompute


def _model(mode: str, dropout: float = 0.1):
    cfg = get_preset("tiny-gpt")
    cfg.dropout = dropout
    model = build_model(cfg, torch.device("cpu"), seed=3)
    apply_recompute(model, mode)
    return model


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 32), generator=g)
    y = torch.randint(0, 256, (2, 32), generator=g)
    return x, y, sample_keys(0, 0, torch.arange(2))


def _forward_counts(model) -> dict[str, int]:
    """Count calls of a child inside each wrapped module (the wrapped forward itself is
    invoked directly by checkpoint, bypassing its own hooks)."""
    counts = {"block": 0, "core": 0}
    for blk in model.blocks:
        blk.attn.register_forward_pre_hook(
            lambda *_: counts.__setitem__("block", counts["block"] + 1)
        )
        blk.attn.core.drop.register_forward_pre_hook(
            lambda *_: counts.__setitem__("core", counts["core"] + 1)
        )
    x, y, keys = _batch()
    model(x, y, keys).backward()
    return counts


@pytest.mark.parametrize(
    ("mode", "blocks", "cores"),
    [("none", 2, 2), ("full", 4, 4), ("selective", 2, 4)],  # tiny-gpt has 2 blocks
)
def test_which_modules_run_twice(mode, blocks, cores):
    assert _forward_counts(_model(mode)) == {"block": blocks, "core": cores}


def _saved_bytes(model) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    x, y, keys = _batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y, keys)
    loss.backward()
    return total


def test_saved_activations_shrink_none_selective_full():
    none, sel, full = (_saved_bytes(_model(m)) for m in ("none", "selective", "full"))
    assert full < sel < none


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradients_identical_with_dropout(mode):
    """Same keys -> same masks in the recomputed forward -> bitwise-equal gradients."""
    grads = {}
    for m in ("none", mode):
        model = _model(m, dropout=0.2)
        x, y, keys = _batch()
        model(x, y, keys).backward()
        grads[m] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["none"], grads[mode], strict=True):
        assert torch.equal(a, b)


def test_names_and_parameters_unchanged():
    plain, wrapped = _model("none"), _model("full")
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in wrapped.named_parameters()]


def test_unknown_mode_message():
    with pytest.raises(ConfigError, match="recompute must be one of none, full, selective"):
        apply_recompute(_model("none"), "sometimes")
