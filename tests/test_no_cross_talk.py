"""Packing without cross-talk and the ignore rule, in one process (fp32, rtol 1e-5).

A packed row of examples of different lengths gives the summed loss and the parameter
gradients of its examples run one by one (learned positions and RoPE with grouped-query
attention; no, selective and full recompute; with dropout, where each example runs alone in
the row's place so its dropout masks are the same); padding rows change nothing; IGNORE
everywhere gives loss 0 and zero gradients. And on masked, variable-length data the old
per-micro-batch mean differs from the token-weighted loss, by a measured amount.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from packed_rows import PackedRows
from plait.build.model import build_model
from plait.models.dropout import sample_keys
from plait.models.loss import IGNORE
from plait.models.packing import Packing
from plait.models.presets import get_preset
from plait.parallel.activation_recompute import apply_recompute

RTOL, ATOL = 1e-5, 1e-6
LENGTHS = (7, 12, 9)  # three examples, then 4 tokens of padding: one row of 32


def _model(preset: str, recompute: str = "none", dropout: float = 0.0):
    cfg = get_preset(preset)
    cfg.dropout = dropout
    model = build_model(cfg, torch.device("cpu"), seed=5)
    apply_recompute(model, recompute)
    return model.train()


def _row(seq: int = 32):
    """One packed row: tokens, targets (prompts IGNORE, pads IGNORE), segments, runs."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (1, seq), generator=gen)
    y = torch.randint(0, 256, (1, seq), generator=gen)
    seg = torch.full((1, seq), len(LENGTHS))  # the padding run
    runs, at = [], 0
    for i, n in enumerate(LENGTHS):
        seg[0, at : at + n] = i
        y[0, at : at + 2] = IGNORE  # a prompt of 2 tokens
        runs.append((at, at + n))
        at += n
    y[0, at:] = IGNORE
    return x, y, seg, runs


def _loss_and_grads(model, *args, **kw):
    model.zero_grad(set_to_none=True)
    loss = model(*args, **kw)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _close(a, b, what=""):
    """rtol 1e-5, and an absolute floor of 1e-5 of the tensor's largest element: summing a
    gradient over the examples in another order than over the row moves its elements near
    zero by rounding (1e-6 seen on gradients of size 6)."""
    atol = max(ATOL, RTOL * float(b.abs().max())) if b.numel() else ATOL
    torch.testing.assert_close(a, b, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


CASES = [(p, r) for p in ("tiny-gpt", "tiny-llama") for r in ("none", "selective", "full")]


@pytest.mark.parametrize(("preset", "recompute"), CASES)
def test_packed_row_equals_its_examples_one_by_one(preset, recompute):
    model = _model(preset, recompute)
    x, y, seg, runs = _row()
    packed, grads = _loss_and_grads(model, x, y, segments=seg, denom=1.0)
    total, summed = torch.zeros(()), {n: torch.zeros_like(g) for n, g in grads.items()}
    for a, b in runs:  # each example alone: a row of its own length, plain causal
        loss, g = _loss_and_grads(model, x[:, a:b], y[:, a:b], denom=1.0)
        total += loss
        for n in summed:
            summed[n] += g[n]
    _close(packed, total, "summed loss")
    for n in grads:
        _close(grads[n], summed[n], n)
    # Without the block mask (plain causal over the packed row) the loss differs: cross-talk.
    crossed = model(x, y, denom=1.0).detach()
    assert abs(crossed - packed) > 10 * RTOL * abs(packed)


@pytest.mark.parametrize(
    ("preset", "recompute"), [("tiny-gpt", "selective"), ("tiny-llama", "full")]
)
def test_packed_row_with_dropout_has_no_cross_talk(preset, recompute):
    """With dropout the masks depend on a token's place in the row, so each example runs in
    its own place with every other example replaced by other tokens (IGNORE targets): the
    explicit attention path with the block mask must give the same per-example losses and
    gradients, summing to the packed row's."""
    model = _model(preset, recompute, dropout=0.1)
    x, y, seg, runs = _row()
    keys = sample_keys(0, 0, torch.arange(1))
    packed, grads = _loss_and_grads(model, x, y, keys, segments=seg, denom=1.0)
    total, summed = torch.zeros(()), {n: torch.zeros_like(g) for n, g in grads.items()}
    for a, b in runs:
        xi, yi = (x + 17) % 256, torch.full_like(y, IGNORE)  # other tokens, no targets
        xi[:, a:b], yi[:, a:b] = x[:, a:b], y[:, a:b]
        loss, g = _loss_and_grads(model, xi, yi, keys, segments=seg, denom=1.0)
        total += loss
        for n in summed:
            summed[n] += g[n]
    _close(packed, total, "summed loss")
    for n in grads:
        _close(grads[n], summed[n], n)


@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-llama"])
def test_padding_rows_change_nothing_and_no_targets_gives_zero(preset):
    model = _model(preset)
    x, y, seg, _ = _row()
    loss, grads = _loss_and_grads(model, x, y, segments=seg)  # the mean over its targets
    ref = F.cross_entropy(model(x, segments=seg).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    _close(loss, ref.detach(), "mean over counted targets")
    pad_x = torch.cat([x, torch.randint(0, 256, x.shape)])
    pad_y = torch.cat([y, torch.full_like(y, IGNORE)])
    pad_seg = torch.cat([seg, torch.zeros_like(seg)])
    padded, padded_grads = _loss_and_grads(model, pad_x, pad_y, segments=pad_seg)
    _close(padded, loss, "padding row")
    for n in grads:
        _close(padded_grads[n], grads[n], n)
    none, zero = _loss_and_grads(model, x, torch.full_like(y, IGNORE), segments=seg)
    assert none.item() == 0.0
    assert all(not g.any() for g in zero.values()), "no targets: every gradient zero"
    none_plain, _ = _loss_and_grads(model, x, torch.full_like(y, IGNORE))
    assert none_plain.item() == 0.0


def test_one_segment_is_the_plain_causal_model():
    """A row that is one example runs the masked kernel and gives the unmasked result."""
    model = _model("tiny-llama")
    x, y, _, _ = _row()
    plain, g_plain = _loss_and_grads(model, x, y)
    one, g_one = _loss_and_grads(model, x, y, segments=torch.zeros_like(x))
    _close(one, plain, "loss")
    for n in g_plain:
        _close(g_one[n], g_plain[n], n)


def test_packing_positions_and_mask():
    seg = torch.tensor([[4, 4, 4, 1, 1, 4, 4]])  # a repeated id in a later run is a new run
    pack = Packing.of(seg)
    assert pack.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    sees = pack.mask[0, 0]
    assert sees[2].tolist() == [True, True, True, False, False, False, False]
    assert sees[4].tolist() == [False, False, False, True, True, False, False]
    assert sees[6].tolist() == [False] * 5 + [True, True]
    assert Packing.of(None) is None
    with pytest.raises(ValueError, match=r"segments must be \(batch, seq\), got shape \(7,\)"):
        Packing.of(seg[0])


def test_per_micro_batch_mean_differs_from_the_token_weighted_loss():
    """The old rule (mean per micro-batch, averaged) against the exact one on the masked,
    variable-length rows the world tests train on, micro-batches of 2 rows: they differ by
    far more than rtol, whether a micro-batch without targets counts as 0 (here 25%) or is
    left out of the average (here 0.15%, an untrained model's token losses being alike;
    transformers' accumulation before PR #34191)."""
    rows = PackedRows(16, 32, 256, seed=3)
    model = _model("tiny-llama").eval()
    idx = torch.arange(16)
    x, y, seg = rows.draw(idx)
    with torch.no_grad():
        exact = float(model(x, y, segments=seg, denom=float(rows.target_count(idx))))
        micro = [(rows.target_count(i), rows.draw(i)) for i in idx.split(2)]
        means = [(n, float(model(xi, yi, segments=si))) for n, (xi, yi, si) in micro]
    counts = [n for n, _ in means]
    assert 0 in counts and len(set(counts)) > 2, counts  # empty and uneven micro-batches
    with_empty = sum(m for _, m in means) / len(means)
    nonempty = [m for n, m in means if n]
    without_empty = sum(nonempty) / len(nonempty)
    for old in (with_empty, without_empty):
        gap = abs(old - exact) / exact
        assert gap > 100 * RTOL, f"per-micro-batch mean {old:.6f} vs token-weighted {exact:.6f}"
