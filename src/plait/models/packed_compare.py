"""One packed batch under several packed-attention modes: how far each lands from the first.

For a check on the hardware a mode runs on (varlen needs CUDA and bf16/fp16): the same
weights and rows under, say, ("mask", "varlen"), and the gaps of the loss and of every
parameter's gradient. On CPU the suite runs it on ("mask", "per-document") in fp32, where
the gaps stay below 1e-5 (tests/test_packed_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from plait.models.transformer import Transformer


@dataclass(frozen=True)
class ModeGap:
    """One mode against the first: its loss, |loss - first's| / |first's|, and the largest
    gradient gap, max |g - g_first| / max |g_first| over a parameter, with that parameter."""

    mode: str
    loss: float
    loss_gap: float
    grad_gap: float
    worst: str


def packed_attention_gaps(
    model: Transformer,
    tokens: Tensor,
    targets: Tensor,
    segments: Tensor,
    modes: tuple[str, ...] = ("mask", "varlen"),
) -> list[ModeGap]:
    """Forward and backward of `model` on (tokens, targets, segments), (b, s) each, once per
    mode, on the model's device and dtype; one ModeGap per mode, the first's gaps 0. The
    model's mode and gradients are as before (gradients cleared). Dropout must be off (eval
    mode, or p = 0): with keyed dropout every mode takes the mask path, and the gaps would
    say nothing."""
    if model.training and model.cfg.dropout > 0:
        raise ValueError(
            f"dropout {model.cfg.dropout} in training sends every packed-attention mode through "
            "the mask: compare in eval mode (model.eval()) or with dropout 0"
        )
    kept, first = model.packed_attention, None
    out = []
    try:
        for mode in modes:
            loss, grads = _loss_and_grads(model, mode, tokens, targets, segments)
            first = first or (loss, grads)
            gap, worst = _largest_gap(grads, first[1])
            out.append(ModeGap(mode, loss, abs(loss - first[0]) / abs(first[0]), gap, worst))
    finally:
        model.packed_attention = kept
        model.zero_grad(set_to_none=True)
    return out


def _loss_and_grads(model: Transformer, mode: str, *batch: Tensor) -> tuple[float, dict]:
    model.packed_attention = mode
    model.zero_grad(set_to_none=True)
    tokens, targets, segments = batch
    loss = model(tokens, targets, segments=segments)
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def _largest_gap(grads: dict[str, Tensor], ref: dict[str, Tensor]) -> tuple[float, str]:
    gaps = {
        n: float((g - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30))
        for n, g in grads.items()
    }
    worst = max(gaps, key=gaps.__getitem__)
    return gaps[worst], worst
