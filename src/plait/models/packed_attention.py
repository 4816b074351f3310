"""Packed rows' attention by document: the work and memory of the documents, not of the row.

A packed row of s tokens holding documents of l₁, l₂, … tokens needs only Σlᵢ² of the s²
query-key pairs (block-causal). Three ways compute it, equal to each other (fp32: rtol 1e-5):

- mask: one SDPA over the row with the dense (b, 1, s, s) additive block-causal mask
  (`Packing.additive`): s² work, the mask held for backward, and on a GPU the explicit mask
  keeps SDPA off its flash kernel. The reference, and the only path for keyed dropout,
  which indexes the whole (b, a, s, s) probabilities (models/dropout.py).
- per-document: one causal SDPA per document (`DocumentAttention`): Σlᵢ² work, no mask.
  Its backward recomputes each document's forward instead of keeping the per-document
  outputs: those would be a second copy of the (b, s, a·hd) output beside the one the output
  projection saves (SDPA cannot write into a slice of one tensor), which costs more than
  the mask for a wide model at s = 2k; recomputing costs one more forward of attention.
- varlen: `torch.nn.attention.varlen.varlen_attn`, flash attention's variable-length kernel
  over the documents' offsets in the flattened (b·s) tokens (CUDA, bf16/fp16): Σlᵢ² work in
  one call; it saves q, k, v, its output (the projection's input, one storage) and the
  log-sum-exp (a, b·s) fp32.

`auto` takes varlen where it runs (CUDA, a 16-bit dtype, a torch that has it); elsewhere on
a GPU the mask (on an H200, a 1.1B model in bf16 on packed rows of 2,048 tokens: the mask
33,437 tokens/s, varlen 26,527, the per-document loop 2,353, its many small kernel launches
and the recomputed forward dominating: BENCHMARKS.md, "GPU check"), and on the CPU the
per-document loop (2-4x faster than the mask there). Keyed dropout in training always takes
the mask.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

MODES = ("auto", "mask", "per-document", "varlen")
VARLEN_DTYPES = (torch.bfloat16, torch.float16)


def varlen_kernel() -> Callable | None:
    """torch's varlen_attn, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_refusal(device_type: str, dtype: torch.dtype | None = None) -> str | None:
    """Why varlen cannot run on `device_type` in `dtype` (None: it can)."""
    if varlen_kernel() is None:
        return (
            f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn "
            "(flash attention's variable-length kernel)"
        )
    if device_type != "cuda":
        return f"varlen_attn is a CUDA kernel (flash attention); this run is on {device_type}"
    if dtype is not None and dtype not in VARLEN_DTYPES:
        return f"varlen_attn (flash attention) runs in bf16 or fp16, not {dtype}"
    return None


def attention_path(mode: str, device_type: str, dtype: torch.dtype, explicit: bool) -> str:
    """The path packed rows take: 'mask', 'per-document' or 'varlen'. `explicit`: keyed
    dropout is on (training, p > 0), which needs the mask path."""
    if mode not in MODES:
        raise ValueError(f"packed attention must be one of {', '.join(MODES)}; got {mode!r}")
    if explicit:
        return "mask"
    if mode == "auto":
        if device_type != "cuda":
            return "per-document"
        return "varlen" if varlen_refusal(device_type, dtype) is None else "mask"
    return mode


def _keep(t: Tensor) -> Tensor:
    return t


def _causal(q: Tensor, k: Tensor, v: Tensor, window: int | None, scale: float | None) -> Tensor:
    """Causal SDPA over one document, seeing the last `window` positions where it is shorter
    than the document."""
    s = q.shape[-2]
    if window is None or window >= s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril().triu(1 - window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class DocumentAttention(torch.autograd.Function):
    """Causal SDPA per document; saves q, k, v only and recomputes each document's forward
    in backward (the module docstring says why)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, documents: list, window, scale) -> Tensor:
        b, a, s, hd = q.shape
        out = q.new_empty(b, s, a, hd)  # (b, s, a, hd): the projection's input is a view
        for row, start, end in documents:
            doc = (t[row : row + 1, :, start:end] for t in (q, k, v))  # (1, a, l, hd)
            y = _causal(*doc, window, scale)  # (1, a, l, hd)
            out[row, start:end] = y[0].transpose(0, 1)  # (l, a, hd)
        ctx.save_for_backward(q, k, v)
        ctx.documents, ctx.window, ctx.scale = documents, window, scale
        return out.transpose(1, 2)  # (b, a, s, hd)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v = ctx.saved_tensors
        grads = [torch.empty_like(t) for t in (q, k, v)]  # every token lies in one document
        # What the recompute saves lives only inside this backward, one document at a time,
        # like a kernel's workspace: identity hooks keep an enclosing saved-tensor hook (the
        # memory meter, activation offload) from taking it for a forward's saved tensor.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            for row, start, end in ctx.documents:
                doc = [t[row : row + 1, :, start:end].detach().requires_grad_() for t in (q, k, v)]
                y = _causal(*doc, ctx.window, ctx.scale)
                parts = torch.autograd.grad(y, doc, grad[row : row + 1, :, start:end])
                for whole, part in zip(grads, parts, strict=True):
                    whole[row : row + 1, :, start:end] = part
        return *grads, None, None, None


def document_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    documents: list,
    window: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """Causal attention within each (row, start, end) of `documents`, which cover every
    token: (b, a, s, hd) in and out, k and v with q's heads; `window`: each position sees
    at most the last that many; `scale`: of q kᵀ (None: 1/sqrt(hd))."""
    return DocumentAttention.apply(q, k, v, documents, window, scale)


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    offsets: Tensor,
    longest: int,
    window: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """Causal attention within each document through torch's varlen_attn: q, k, v (b, a, s,
    hd), `offsets` int32 (documents + 1,) into the b·s tokens, `longest` the longest document;
    a clear error where it cannot run."""
    refusal = varlen_refusal(q.device.type, q.dtype)
    if refusal is not None:
        raise ValueError(f"packed attention 'varlen' cannot run: {refusal}")
    return varlen_through(varlen_kernel(), q, k, v, offsets, longest, window, scale)


def varlen_through(
    kernel: Callable,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    offsets: Tensor,
    longest: int,
    window: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """`kernel` (varlen_attn's signature) on q, k, v (b, a, s, hd) flattened to (b·s, a, hd)
    (a view where the heads' layout allows), and its output back to (b, a, s, hd). A sliding
    `window` w is flash attention's window (w - 1, 0): w - 1 keys before the query and none
    after; a kernel that takes no window cannot run one."""
    b, a, s, hd = q.shape
    flat = [t.transpose(1, 2).reshape(b * s, a, hd) for t in (q, k, v)]  # (b·s, a, hd)
    # Causality was `is_causal=True` in torch 2.10's varlen_attn; later ones take a window,
    # (-1, 0) being causal with no left limit.
    params = inspect.signature(kernel).parameters
    left = -1 if window is None else window - 1
    if "window_size" in params:
        causal = {"window_size": (left, 0)}
    elif window is None:
        causal = {"is_causal": True}
    else:
        raise ValueError("this torch's varlen_attn takes no window: a sliding window cannot run")
    extra = {} if scale is None else {"scale": scale}
    out = kernel(*flat, offsets, offsets, longest, longest, **causal, **extra)  # (b·s, a, hd)
    return out.view(b, s, a, hd).transpose(1, 2)  # (b, a, s, hd)
