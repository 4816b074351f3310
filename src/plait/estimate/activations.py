"""Activation bytes per micro-batch: what autograd saves for backward, site by site.

Korthikanti et al. (2022, section 4.1) count the tensors each site of a block saves; this
file does the same for the sites *plait's* model has, with the kernels it runs, so that the
figure matches what the memory tracker measures (saved-for-backward bytes). Symbols: b
micro-batch, s sequence, h hidden, a heads, f MLP hidden, t tensor-parallel ranks, e bytes
of the compute dtype; H = sbh, Hr = H/t under sequence parallelism (else H), Hc = H/t,
F = sbf/t, A = b(a/t)s².

Per block, no recomputation:
  each norm (2):   LayerNorm Hr·e + 2(bs/t_sp)·e (input, mean, rstd);
                   RMSNorm  Hr·4 + (bs/t_sp)·4 + Hr·e (fp32 input, 1/rms, normalized)
  Linear inputs:   2·H·e (after each norm; all-gathered under SP, so never /t)
  q, k, v:         3·Hc·e (k, v repeated to a/t heads under grouped-query attention; Hc is
                   sb·a·hd/t where the head size is not h/a, as Qwen3's)
  q/k head norms:  (Qwen3) as an RMSNorm, per rank: n·4 + (bs·heads)·4 + n·e for q's a/t
                   heads and k's kv/t, n = bs·heads·hd
  attention core:  fused (dropout 0): b(a/t)s·4 (log-sum-exp);
                   explicit (dropout > 0): s² (causal mask) + A·(4 + 1 + e) (fp32 softmax,
                   dropout mask, dropped probabilities)  -- Korthikanti's 5as²b;
                   soft-capped scores (Gemma 2, explicit without a fused kernel) add A·e
                   (tanh's output), the mask byte only with dropout; a sliding window on
                   text rows: s² (the fused kernel saves the windowed bool mask)
  Gemma:           four norms, each saving its normalized input in fp32
  RoPE:            2·s·(h/a)·4 (cos, sin)
  out projection:  Hc·e
  MLP:             GELU 2·F·e; SwiGLU 4·F·e
  dropout masks:   2·Hr bytes (when dropout > 0)
Packed rows (instruction data, `MicroShape.packed`): RoPE's cos and sin are per token,
2·b·s·(h/a)·4; learned positions are per token, b·s·8. Attention takes the path
`MicroShape.attention` names (models/packed_attention.py): on the mask path the explicit path adds
the block-causal mask (nothing saved) instead of masking with the causal s² one, and the mask
itself, b·s²·e, is one tensor for all the layers of a chunk (`mask_bytes`); by document no
mask, and per-document no log-sum-exp either (its backward recomputes each document's
forward); varlen saves what the fused kernel does, its offsets' (documents + 1)·4 bytes and a
16-byte RNG state per layer left out (data-dependent, and negligible).
Context parallelism (`Shape.cp`): s is the rank's s/cp tokens, positions are per token, and
attention adds `context_bytes` (allgather: the gathered K and V, and a (b, 1, s, s·cp) mask
per chunk; ring: its fp32 output).
Selective recomputation keeps q, k, v and drops the core's own tensors; full keeps the
block input Hr·e only. The embedding, final norm, head and loss add their own (`extras`).
Plait saves the all-gathered Linear inputs under SP where Megatron re-gathers them, and its
fused attention has no s² term without dropout: both differ from the paper's 34sbh + 5as²b.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.models.architecture import ModelConfig
from plait.models.block_table import block_table

INDEX = 8  # int64 token ids and positions


@dataclass(frozen=True)
class MicroShape:
    """One micro-batch on one rank: the symbols of the module docstring."""

    b: int
    s: int
    t: int
    sp: bool
    e: int  # bytes of the compute dtype
    packed: bool = False  # packed instruction rows: a block-causal mask, per-token positions
    attention: str = "mask"  # packed rows' path: mask, per-document or varlen
    cp: int = 1  # context-parallel ranks: s is then the rank's s/cp tokens of each row
    exchange: str = "allgather"  # context parallelism's exchange (allgather or ring)

    def res(self, model: ModelConfig) -> int:
        """Hr: residual-stream elements (sequence-sharded under SP)."""
        return self.b * self.s * model.d_model // (self.t if self.sp else 1)

    def rows(self) -> int:
        """Tokens of the residual stream on this rank (bs, or bs/t under SP)."""
        return self.b * self.s // (self.t if self.sp else 1)


def norm_bytes(model: ModelConfig, x: MicroShape) -> int:
    """One norm's saved tensors (LayerNorm on CPU keeps its statistics in the dtype; Gemma's
    scales the fp32 normalized input by 1 + w before rounding, so saves it in fp32)."""
    if model.norm == "layernorm":
        return x.res(model) * x.e + 2 * x.rows() * x.e
    normed = 4 if model.gemma else x.e
    return x.res(model) * 4 + x.rows() * 4 + x.res(model) * normed


def block_norms(model: ModelConfig) -> int:
    """Norms over the residual stream in a block: 2, Gemma's 4 (after each sublayer too)."""
    return sum(1 for r in block_table(model).norms if r.over == "h")


def core_bytes(model: ModelConfig, x: MicroShape, recompute: str) -> int:
    """The attention core's own tensors (beyond q, k, v and its output)."""
    if recompute == "selective":
        return 0
    heads = model.n_heads // x.t
    if model.dropout == 0.0 and model.attn_softcap is None:  # fused: log-sum-exp; per document none
        # a sliding window on text rows: the fused kernel saves the layer's (s, s) bool mask
        # (counted on every layer: Gemma 3's global ones, one in six, have none)
        window = x.s * x.s if model.sliding_window is not None and not x.packed else 0
        return window + (0 if x.packed and x.attention == "per-document" else x.b * heads * x.s * 4)
    scores = x.b * heads * x.s * x.s
    causal = 0 if x.packed else x.s * x.s  # packed rows add their mask: no bool is saved
    capped = x.e if model.attn_softcap is not None else 0  # tanh's output (Gemma 2)
    dropped = 1 if model.dropout > 0.0 else 0  # the keyed mask
    return causal + scores * (capped + 4 + dropped + x.e)


def rope_bytes(model: ModelConfig, x: MicroShape) -> int:
    """RoPE's fp32 cos and sin, which each layer makes and its rotations save: (s, h/a)
    each for text windows, per token (b, 1, s, h/a) for packed rows (positions restart)."""
    if model.pos != "rope":
        return 0
    return 2 * (x.b if x.packed else 1) * x.s * model.head_dim * 4


def head_norm_bytes(model: ModelConfig, x: MicroShape) -> int:
    """The RMSNorms over each head of q and of k (Qwen3's, before RoPE), saving what a norm
    saves (fp32 input, 1/rms per head, normalized) over this rank's heads; 0 without them."""
    if not any(r.over == "head" for r in block_table(model).norms):
        return 0
    out = 0
    for heads in (model.n_heads // x.t, model.kv_heads // x.t):
        n = x.b * x.s * heads * model.head_dim
        out += n * 4 + x.b * x.s * heads * 4 + n * x.e
    return out


def mask_bytes(model: ModelConfig, x: MicroShape, recompute: str) -> int:
    """Packed rows' additive block-causal mask (b, 1, s, s) of the compute dtype, once per
    micro-batch and chunk: one tensor (models/packing.py) that every layer's fused attention
    saves, or selective recomputation's checkpoint as the core's input, so one storage
    however many layers. Nothing saves it under full recomputation (the checkpoint saves the
    block input only) nor on the explicit dropout path (an addition saves nothing), and
    packed rows attended by document have none."""
    if not x.packed or x.attention != "mask" or recompute == "full":
        return 0
    if model.dropout > 0.0 and recompute != "selective":
        return 0
    if x.cp > 1:  # the rank's rows of the rule against the whole row; the ring saves none
        return x.b * x.s * x.s * x.cp * x.e if x.exchange == "allgather" else 0
    return x.b * x.s * x.s * x.e


def context_bytes(model: ModelConfig, x: MicroShape, recompute: str) -> int:
    """What a context-parallel rank's attention saves beyond its own tokens' q, k, v
    (parallel/cp): allgather's attention saves the whole row's gathered K and V, cp times
    its own (2·(cp−1)·Hc·e more); the ring keeps its fp32 output for its backward (Hc·4),
    a copy beside the projection's input, which recomputation of the core drops."""
    if x.cp == 1 or recompute == "full":
        return 0
    col = x.b * x.s * model.d_model // x.t
    if x.exchange == "allgather":
        return 2 * (x.cp - 1) * col * x.e
    return 0 if recompute == "selective" else col * 4


def layer_bytes(model: ModelConfig, x: MicroShape, recompute: str) -> int:
    """Saved bytes of one transformer block for one micro-batch."""
    if recompute == "full":
        return x.res(model) * x.e
    full = x.b * x.s * model.d_model
    col = x.b * x.s * model.n_heads * model.head_dim // x.t  # q's width: a·hd (h unless decoupled)
    mlp = x.b * x.s * model.ffn_dim // x.t
    total = block_norms(model) * norm_bytes(model, x) + 2 * full * x.e + 3 * col * x.e + col * x.e
    total += core_bytes(model, x, recompute) + rope_bytes(model, x) + head_norm_bytes(model, x)
    total += context_bytes(model, x, recompute)
    total += (2 if model.mlp == "gelu" else 4) * mlp * x.e
    if model.dropout > 0.0:
        total += 2 * x.res(model)
    return total


def first_freed_bytes(model: ModelConfig, x: MicroShape, recompute: str) -> int:
    """What a block's backward frees before its first gradient arrives (the moment
    `estimate/peak.py` counts a block at): the output dropout's mask and the MLP down
    projection's input, F·e, saved by the nodes it runs first; under full recomputation
    nothing the meter sees."""
    if recompute == "full":
        return 0
    return x.b * x.s * model.ffn_dim // x.t * x.e + (x.res(model) if model.dropout > 0.0 else 0)


def head_first_freed_bytes(model: ModelConfig, x: MicroShape) -> int:
    """What the loss's backward frees before the head's gradient arrives: its saves but
    the row indices (`target_rows_bytes` less n·8)."""
    return target_rows_bytes(model, x) - x.b * x.s * INDEX


def received_input_bytes(model: ModelConfig, x: MicroShape, recompute: str) -> int:
    """What a non-first pipeline stage would save of its received input, which the tracker
    counts as a receive buffer instead (a leaf): LayerNorm's input, RMSNorm's fp32 input
    when the dtype is fp32, or the checkpointed block's input."""
    if recompute == "full" or model.norm == "layernorm" or x.e == 4:
        return x.res(model) * x.e
    return 0


def embedding_bytes(model: ModelConfig, x: MicroShape) -> int:
    """The first stage: token ids (tp: local ids and the foreign mask), positions, dropout.
    Packed rows' positions are per token (b, s), and a sequence-parallel shard's are a view
    of them: the whole storage is saved."""
    bs = x.b * x.s
    total = bs * INDEX + (bs if x.t > 1 else 0)
    if model.pos == "learned":
        total += bs * INDEX if x.packed else x.s // (x.t if x.sp else 1) * INDEX
    if model.dropout > 0.0:
        total += x.res(model)
    return total


def head_bytes(model: ModelConfig, x: MicroShape, vocab_local: int) -> int:
    """The last stage: final norm and the lighter loss's saves (models/light_loss.py).

    The loss keeps no logits (each chunk's are recomputed in backward), only the selected
    head inputs, their row indices, targets and log-sum-exps (`target_rows_bytes`); the
    vocabulary (`vocab_local`) no longer enters the saved bytes."""
    return norm_bytes(model, x) + target_rows_bytes(model, x)


def full_logits_head_bytes(model: ModelConfig, x: MicroShape, vocab_local: int) -> int:
    """What the last stage saved before the lighter loss, and what a plain head and loss
    (logits for every position) still save: final norm, head input, the fp32 (log-)softmax
    of all b·s rows' logits, targets, and tp's 'mine' mask or else NLL's total weight. Not
    the run's term (`head_bytes` is): the lesson that measures the saving compares with it."""
    bs = x.b * x.s
    total = norm_bytes(model, x) + bs * model.d_model * x.e + bs * vocab_local * 4 + bs * INDEX
    return total + (bs if x.t > 1 else 4)


def target_rows_bytes(model: ModelConfig, x: MicroShape, rows: int | None = None) -> int:
    """What the lighter loss saves for `rows` target rows (default b·s, every position has
    a target as in text windows; instruction data has fewer): each row's head input (h·e),
    its index (the row selection's backward), its target and its fp32 log-sum-exp."""
    n = x.b * x.s if rows is None else rows
    return n * (model.d_model * x.e + 2 * INDEX + 4)
