"""Vocabulary parallelism: embedding, head and cross-entropy with the vocabulary split.

The embedding table (V, h) and the output head (V, h) are the largest matrices of a small
or mid-size model. Split by vocabulary rows, rank r owns tokens [r V/tp, (r+1) V/tp):

- embedding: each rank looks up the tokens it owns and writes zeros for the others; the
  sum over ranks (all-reduce, or reduce-scatter along the sequence under SP) is the lookup.
- head: a column-parallel Linear whose output is this rank's (b, s, V/tp) slice of the
  logits. With tied embeddings it uses the embedding's shard, whose rows are the same.
- loss: cross-entropy from the logit slices, exchanging only per-token scalars (the max,
  the sum of exponentials, the target's logit): full logits never exist on one rank
  (Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al., 2019, section 3). It keeps
  the model's loss rule (models/loss.py): IGNORE targets add nothing and get no gradient,
  and the sum is divided by the given `denom` (None: the mean over counted targets).

A vocabulary not divisible by tp is padded to the next multiple: padding rows are zero,
no token looks them up, the loss masks their logits to -inf so they get zero gradient (Adam
and weight decay then keep them zero), and `ShardSpec.unpadded` drops them on export.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.comm import Comm
from plait.models.dropout import KeyedDropout
from plait.models.gemma import scale_embeddings
from plait.models.loss import IGNORE, reduce_losses
from plait.models.packing import Packing
from plait.parallel.tp.layers import ShardedDropout, copy_from_full, new_shard, tp_coords
from plait.parallel.tp.mappings import exit_region, gather_from_tp
from plait.parallel.tp.sharding import split_spec


class VocabParallelEmbedding(nn.Module):
    """Token lookup with the table split by vocabulary rows: (b, s) -> (b, s, h).

    Under sequence parallelism the output is this rank's sequence shard (b, s/tp, h): the
    reduce-scatter that sums the partial lookups also splits them, at no extra cost.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        comm: Comm,
        *,
        sequence_parallel: bool = False,
        tag: str = "tp-embed",
        like: Tensor | None = None,
    ) -> None:
        super().__init__()
        rank, size = tp_coords(comm)
        self.comm, self.sequence_parallel, self.tag = comm, sequence_parallel, tag
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        spec = split_spec((num_embeddings, embedding_dim), 0, rank, size, pad=True)
        self.weight_spec = spec
        self.weight = new_shard(spec, like if like is not None else torch.empty(0))
        self.vocab_start, self.num_local = spec.offsets[0], spec.local_shape[0]

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, comm: Comm, **kw) -> VocabParallelEmbedding:
        layer = cls(emb.num_embeddings, emb.embedding_dim, comm, like=emb.weight, **kw)
        copy_from_full(layer.weight, emb.weight, layer.weight_spec)
        return layer

    def forward(self, tokens: Tensor) -> Tensor:
        local = tokens - self.vocab_start  # (b, s)
        foreign = (local < 0) | (local >= self.num_local)  # tokens other ranks own
        x = F.embedding(local.masked_fill(foreign, 0), self.weight)  # (b, s, h)
        x = x.masked_fill(foreign.unsqueeze(-1), 0.0)  # partial: only this rank's tokens
        return exit_region(x, self.comm, self.sequence_parallel, self.tag)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, "
            f"{self.vocab_start + self.num_local}) + {self.weight_spec.padding} pad"
        )


class ParallelEmbedding(nn.Module):
    """The model's Embedding with a vocab-parallel token table (same names: tok, pos, drop).

    Under sequence parallelism the lookup arrives as this rank's positions
    [r s/tp, (r+1) s/tp): learned positions (a packed row's per-token ones: the shard's
    slice of them) and dropout apply to that shard only, the
    position table's gradient is partial (the contract says so; grads.py sums it over tp)
    and the dropout mask is the shard's slice of the single-process mask.
    """

    def __init__(
        self,
        tok: nn.Embedding,
        pos: nn.Embedding | None,
        drop: KeyedDropout,
        comm: Comm,
        sequence_parallel: bool,
        scaled: bool = False,
    ) -> None:
        """`tok`, `pos` (None: no learned positions), `drop` and `scaled` (Gemma's sqrt(h)
        factor) of the model's Embedding."""
        super().__init__()
        (self.rank, self.size), self.sequence_parallel = tp_coords(comm), sequence_parallel
        self.tok = VocabParallelEmbedding.from_embedding(
            tok, comm, sequence_parallel=sequence_parallel
        )
        self.pos = pos  # None stays a plain attribute: the names are the model's
        self.scaled = scaled
        self.drop = ShardedDropout.from_dropout(drop, 1, comm) if sequence_parallel else drop

    def forward(
        self,
        tokens: Tensor,
        keys: Tensor | None = None,
        start: int = 0,
        pack: Packing | None = None,
    ) -> Tensor:
        """`start` (decoding) is the model Embedding's; tensor parallelism never decodes."""
        if start:
            raise ValueError("a tensor-parallel embedding does not decode from a cache")
        if self.sequence_parallel and tokens.shape[1] % self.size:
            raise ValueError(
                f"sequence length {tokens.shape[1]} is not divisible by tp={self.size} "
                "(sequence parallelism splits every sequence across tp ranks)"
            )
        x = self.tok(tokens)  # (b, s, h), or (b, s/tp, h) under SP
        if self.scaled:
            x = scale_embeddings(x)
        if self.pos is not None:
            s, local = tokens.shape[1], x.shape[1]
            if s > self.pos.num_embeddings:
                raise ValueError(
                    f"sequence length {s} exceeds max_seq_len {self.pos.num_embeddings}"
                )
            first = self.rank * local if self.sequence_parallel else 0
            if pack is None:
                x = x + self.pos(torch.arange(first, first + local, device=tokens.device))
            else:
                x = x + self.pos(pack.rows(first, local))  # (b, local, h)
        return self.drop(x, keys)


class VocabParallelCrossEntropyFn(torch.autograd.Function):
    """Per-token cross-entropy from logit slices (n, V/tp); exchanges (n,)-sized buffers only.

    loss_i = log sum_v exp(z_iv - m_i) - (z_i,t_i - m_i), with m_i the global max (for
    stability; any constant gives the same loss and gradient). Gradient: softmax minus the
    one-hot target, computed from the saved local softmax without communication.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, comm: Comm, start: int, real: int, tag: str):
        _, exp, sums, index, mine = _slice_sums(logits, targets, comm, start, real, tag)
        counted = targets != IGNORE  # (n,) IGNORE: no loss, no gradient
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine, counted)
        return torch.where(counted, sums[0].log() - sums[1], 0.0)  # (n,)

    @staticmethod
    def backward(ctx, grad: Tensor):
        softmax, index, mine, counted = ctx.saved_tensors
        scale = torch.where(counted, grad, 0.0).unsqueeze(-1)  # (n, 1)
        out = softmax * scale  # (n, V/tp)
        out.scatter_add_(-1, index, -mine.unsqueeze(-1).to(out) * scale)  # minus the one-hot
        return out, None, None, None, None, None


def _slice_sums(logits: Tensor, targets: Tensor, comm: Comm, start: int, real: int, tag: str):
    """The forward's exchange: the global max per row, this slice's exp(z - max), and the
    all-reduced (sum of exponentials, target's shifted logit) (2, n); the target's index
    into the slice and whether this rank owns it."""
    if real < logits.shape[-1]:  # padding columns: exp(-inf) = 0, no loss, no gradient
        logits = logits.masked_fill(_padding_columns(logits, real), float("-inf"))
    peak = logits.max(dim=-1).values  # (n,)
    comm.all_reduce(peak, "tp", op="max", tag=tag)
    shifted = logits - peak.unsqueeze(-1)  # (n, V/tp)
    local = targets - start
    mine = (local >= 0) & (local < real)  # (n,) targets this rank owns
    index = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)  # (n, 1)
    target = torch.where(mine, shifted.gather(-1, index).squeeze(-1), 0.0)  # (n,)
    exp = shifted.exp()  # (n, V/tp)
    sums = torch.stack((exp.sum(dim=-1), target))  # (2, n): one call for both sums
    comm.all_reduce(sums, "tp", tag=tag)
    return peak, exp, sums, index, mine


def _padding_columns(logits: Tensor, real: int) -> Tensor:
    """(V/tp,) bool: columns of this rank's slice beyond the real vocabulary."""
    return torch.arange(logits.shape[-1], device=logits.device) >= real


class VocabParallelCrossEntropy(nn.Module):
    """Token cross-entropy (fp32) from vocabulary-sharded logits (b, s, V/tp), by the model's
    loss rule (models/loss.py): summed over targets that are not IGNORE, divided by `denom`.

    Replaces the model's `loss` submodule; every tp rank returns the same loss, and each
    rank's backward fills only the gradient of its own logit slice. Targets are token ids in
    [0, V) or IGNORE (prompt tokens and pads of instruction data): an ignored token's loss
    is 0 and its logits get no gradient.
    """

    def __init__(self, vocab_size: int, comm: Comm, tag: str = "tp-loss") -> None:
        super().__init__()
        rank, size = tp_coords(comm)
        self.comm, self.tag, self.vocab_size = comm, tag, vocab_size
        self.spec = split_spec((vocab_size,), 0, rank, size, pad=True)

    def forward(self, logits: Tensor, targets: Tensor, denom: float | None = None) -> Tensor:
        if logits.shape[-1] != self.spec.shape[0]:
            raise ValueError(
                f"expected logits with {self.spec.shape[0]} vocabulary columns (this rank's "
                f"slice of {self.vocab_size}), got shape {tuple(logits.shape)}"
            )
        flat = targets.flatten()
        return reduce_losses(self.token_losses(logits.flatten(0, 1), flat), flat, denom)

    def token_losses(self, logits: Tensor, targets: Tensor) -> Tensor:
        """(n, V/tp) logit slices, (n,) targets -> (n,) fp32 losses, 0 where ignored."""
        start, real = self.spec.offsets[0], self.spec.local_shape[0]
        return VocabParallelCrossEntropyFn.apply(
            logits.float(), targets, self.comm, start, real, self.tag
        )

    @property
    def vocab(self) -> tuple[int, int]:
        """(first token, real columns) of this rank's logit slice."""
        return self.spec.offsets[0], self.spec.local_shape[0]

    def chunk_losses(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """The lighter loss's step (models/light_loss.py), without autograd: (c, V/tp)
        slices and (c,) counted targets -> (c,) fp32 losses and the global log-sum-exp,
        with the same two all-reduces as the plain loss."""
        start, real = self.vocab
        peak, _, sums, _, _ = _slice_sums(logits.float(), targets, self.comm, start, real, self.tag)
        log_sum = sums[0].log()
        return log_sum - sums[1], peak + log_sum

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, slice {self.spec.region()[0]}"


def gather_logits(logits: Tensor, comm: Comm, vocab_size: int) -> Tensor:
    """Full logits (b, s, V) from every rank's slice (b, s, V_padded/tp), padding dropped.

    For generation and inspection only: training never needs them (the loss reads slices).
    """
    return gather_from_tp(logits, comm, tag="tp-head").narrow(-1, 0, vocab_size)
