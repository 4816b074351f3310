"""Packed attention by document (models/packed_attention.py) against the dense mask, in one
process (fp32, rtol 1e-5): rows of one, two and many documents and padding, learned positions
and RoPE with grouped-query attention, no, selective and full recomputation, activation
offload; the runs as offsets and documents; which path each mode takes where; varlen's
refusals; and the mode comparison the GPU check runs (models/packed_compare.py). Every layout
in a world is checked through the exact-loss tests, whose single-process reference attends
through the mask."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from plait.build.model import build_model
from plait.composition import check_packed_attention
from plait.errors import ConfigError
from plait.models.dropout import sample_keys
from plait.models.loss import IGNORE
from plait.models.packed_attention import (
    attention_path,
    varlen_attention,
    varlen_kernel,
    varlen_through,
)
from plait.models.packed_compare import packed_attention_gaps
from plait.models.packing import Packing
from plait.models.presets import get_preset
from plait.parallel.activation_offload import apply_activation_offload
from plait.parallel.activation_recompute import apply_recompute

RTOL = 1e-5
# Four rows of 32: one document; two; many, then padding; one, then padding.
LAYOUTS = ((32,), (20, 12), (3, 1, 5, 2, 7, 4, 6), (9,))


def _batch():
    """Tokens, targets (a 2-token prompt per document IGNORE, padding IGNORE), segments."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(0, 256, (len(LAYOUTS), 32), generator=gen)
    y = torch.randint(0, 256, (len(LAYOUTS), 32), generator=gen)
    seg = torch.zeros_like(x)
    for r, lengths in enumerate(LAYOUTS):
        at = 0
        for i, n in enumerate(lengths):
            seg[r, at : at + n], y[r, at : at + min(2, n - 1)] = i, IGNORE
            at += n
        seg[r, at:], y[r, at:] = len(lengths), IGNORE  # padding: a run of its own
    return x, y, seg


def _model(preset: str, recompute: str = "none", dropout: float = 0.0, offload: str = "none"):
    cfg = get_preset(preset)
    cfg.dropout = dropout
    model = build_model(cfg, torch.device("cpu"), seed=3)
    apply_recompute(model, recompute)
    apply_activation_offload(model, offload)  # saved tensors through hooks of its own
    return model.train()


def _run(model, mode: str, *batch):
    model.packed_attention = mode
    model.zero_grad(set_to_none=True)
    keys = sample_keys(1, 0, torch.arange(len(batch[0])))  # dropout's, if any
    loss = model(*batch[:2], keys, segments=batch[2])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


CASES = [(p, r, "none") for p in ("tiny-gpt", "tiny-llama") for r in ("none", "selective", "full")]
CASES += [("tiny-llama", "none", "cpu"), ("tiny-llama", "full", "cpu")]  # activation offload


@pytest.mark.parametrize(("preset", "recompute", "offload"), CASES)
def test_per_document_equals_the_mask(preset, recompute, offload):
    model, batch = _model(preset, recompute, offload=offload), _batch()
    loss, grads = _run(model, "mask", *batch)
    doc_loss, doc_grads = _run(model, "per-document", *batch)
    auto_loss, _ = _run(model, "auto", *batch)  # on CPU: per-document
    torch.testing.assert_close(doc_loss, loss, rtol=RTOL, atol=0)
    assert auto_loss == doc_loss
    for name, g in grads.items():
        # rounding moves elements near zero; a key bias's gradient is zero but for rounding
        atol = max(1e-7, RTOL * float(g.abs().max()))
        torch.testing.assert_close(doc_grads[name], g, rtol=RTOL, atol=atol, msg=name)


def test_dropout_in_training_takes_the_mask_path():
    """Keyed dropout needs the whole probabilities: every mode gives the mask's bits."""
    model, batch = _model("tiny-gpt", dropout=0.1), _batch()
    assert _run(model, "mask", *batch)[0] == _run(model, "auto", *batch)[0]
    model.eval()
    with torch.no_grad():  # no dropout in evaluation: by document again
        model.packed_attention = "per-document"
        doc = model(*batch[:2], segments=batch[2])
        model.packed_attention = "mask"
        torch.testing.assert_close(doc, model(*batch[:2], segments=batch[2]), rtol=RTOL, atol=0)


def test_runs_as_offsets_and_documents():
    seg = torch.tensor([[4, 4, 4, 1, 1, 4, 4], [0, 0, 0, 0, 0, 0, 0]])
    pack = Packing.of(seg)
    offsets, longest = pack.offsets()
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 3, 5, 7, 14]
    assert longest == 7
    assert pack.documents() == [(0, 0, 3), (0, 3, 5), (0, 5, 7), (1, 0, 7)]
    with pytest.raises(ValueError, match="packed attention must be one of auto, mask, per-doc"):
        Packing.of(seg, "dense")


def test_which_path_each_mode_takes():
    f32, bf16 = torch.float32, torch.bfloat16
    assert attention_path("auto", "cpu", f32, False) == "per-document"
    assert attention_path("auto", "cpu", bf16, False) == "per-document"
    assert attention_path("auto", "cuda", f32, False) == "mask"  # flash: 16-bit only
    cuda_path = "varlen" if varlen_kernel() is not None else "mask"  # the loop is slow there
    assert attention_path("auto", "cuda", bf16, False) == cuda_path
    for mode in ("auto", "per-document", "varlen"):
        assert attention_path(mode, "cuda", bf16, True) == "mask"  # keyed dropout
    assert attention_path("mask", "cpu", f32, False) == "mask"


def _kernel(query, key, value, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1)):
    """varlen_attn's contract on the CPU: (T, a, hd) in and out, causal per document."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    bounds = cu_q.tolist()
    assert max_q == max_k == max(z - a for a, z in pairwise(bounds))
    out = torch.empty_like(query)
    for a, z in pairwise(bounds):
        doc = (t[a:z].transpose(0, 1) for t in (query, key, value))  # (a, l, hd)
        out[a:z] = F.scaled_dot_product_attention(*doc, is_causal=True).transpose(0, 1)
    return out


def _kernel_2_10(query, key, value, cu_q, cu_k, max_q, max_k, is_causal=False):
    """torch 2.10's signature: causality as a flag."""
    assert is_causal
    return _kernel(query, key, value, cu_q, cu_k, max_q, max_k, window_size=(-1, 0))


@pytest.mark.parametrize("kernel", [_kernel, _kernel_2_10])
def test_varlen_glue_flattens_and_restores_the_rows(kernel):
    """What varlen_attention hands the kernel and makes of its output (the kernel itself
    runs on CUDA only): a reference kernel on the CPU gives per-document's values and
    gradients, on rows of one, two and many documents and padding."""
    pack = Packing.of(_batch()[2], "per-document")
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(4, 32, 3, 4, 8, generator=gen, requires_grad=True)  # (b, s, 3, a, hd)
    q, k, v = (base[:, :, i].transpose(1, 2) for i in range(3))  # (b, a, s, hd), a view
    want = pack.attend(q, k, v)
    (want_grad,) = torch.autograd.grad(want.square().sum(), base)
    got = varlen_through(kernel, q, k, v, *pack.offsets())
    (got_grad,) = torch.autograd.grad(got.square().sum(), base)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6)
    atol = RTOL * float(want_grad.abs().max())  # a first token's q gradient: 0 but rounding
    torch.testing.assert_close(got_grad, want_grad, rtol=RTOL, atol=atol)


def test_varlen_refusals():
    q = torch.zeros(1, 2, 4, 8)
    offsets = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="'varlen' cannot run: varlen_attn is a CUDA kernel"):
        varlen_attention(q, q, q, offsets, 4)
    with pytest.raises(ConfigError, match=r"^--packed-attention varlen cannot run: .* on cpu;"):
        check_packed_attention("varlen", "cpu", "bf16", 0.0)
    if varlen_kernel() is not None:
        with pytest.raises(ConfigError, match=r"bf16 or fp16, not torch\.float32"):
            check_packed_attention("varlen", "cuda", "fp32", 0.0)
    with pytest.raises(ConfigError, match=r"per-document cannot apply dropout 0\.1"):
        check_packed_attention("per-document", "cpu", "fp32", 0.1)
    with pytest.raises(ConfigError, match="must be one of auto, mask, per-document, varlen"):
        check_packed_attention("flash", "cpu", "fp32", 0.0)
    check_packed_attention("auto", "cpu", "fp32", 0.1)  # auto takes the mask for dropout


def test_mode_gaps_as_the_gpu_check_reads_them():
    model, batch = _model("tiny-llama"), _batch()
    model.packed_attention = "auto"
    first, doc = packed_attention_gaps(model, *batch, modes=("mask", "per-document"))
    assert (first.mode, first.loss_gap, first.grad_gap) == ("mask", 0.0, 0.0)
    assert doc.mode == "per-document" and doc.loss_gap < RTOL and doc.grad_gap < RTOL
    assert model.packed_attention == "auto"
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="'varlen' cannot run"):
        packed_attention_gaps(model, *batch)
    with pytest.raises(ValueError, match=r"dropout 0\.1 in training sends every packed-att"):
        packed_attention_gaps(_model("tiny-gpt", dropout=0.1), *batch)
