"""The lighter loss: head and cross entropy over the target rows only, in chunks.

The plain last stage computes logits (b, s, V) for every position and saves their fp32
softmax for backward: b·s·V·4 bytes, the largest activation of a small model with a large
vocabulary. Positions whose target is IGNORE (instruction data's prompt tokens and pads)
need no logits at all. `target_rows_loss` selects the rows whose target counts, runs the
head matmul and the loss over them `CHUNK` rows at a time, keeps only the running sum, and
saves just the selected head inputs and their targets; backward recomputes each chunk's
logits and softmax (`_ChunkedHeadLoss`), so neither forward nor backward ever holds more
than one chunk's (CHUNK, V) logits. Each row's loss and input gradient are the plain
computation's; the sums over rows (the loss, the head's weight gradient) only change their
order of addition, so they agree to rounding (rtol 1e-6 in fp32).

The head must be a plain matmul (no bias, no adapter: `ModelContract.plain_head`, from its
declaration); the loss module supplies the
per-token losses (`token_losses`), so the vocabulary-parallel loss works unchanged: targets
are replicated over tp, every rank selects the same rows and runs the same chunks, and its
collectives stay matched. Selecting rows reads their count on the host (one synchronization
per micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from plait.models.loss import IGNORE, reduce_losses

CHUNK = 4096  # rows per chunk: one chunk's (CHUNK, V_local) fp32 logits at a time

# (c, V_local) logits, (c,) targets -> (c,) fp32 losses and (c,) fp32 log-sum-exp over
# the whole vocabulary (all tp ranks'): the loss module's `chunk_losses`.
ChunkLosses = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum_i loss(rows_i @ weight^T, targets_i), chunk by chunk; backward recomputes.

    Forward saves each row's log-sum-exp (one fp32 per row), so backward rebuilds the
    softmax slice exp(z - lse) of each chunk without any collective: d loss / d z is the
    softmax minus the one-hot target (where this rank owns it), and the tp loss keeps its
    two forward all-reduces per chunk and nothing more.
    """

    @staticmethod
    def forward(ctx, rows: Tensor, weight: Tensor, targets: Tensor, fn: ChunkLosses, vocab, chunk):
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        lse = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        for i in range(0, rows.shape[0], chunk):
            logits = F.linear(rows[i : i + chunk], weight)  # (c, V_local)
            losses, lse[i : i + chunk] = fn(logits, targets[i : i + chunk])
            total += losses.sum()
        ctx.save_for_backward(rows, weight, targets, lse)
        ctx.vocab, ctx.chunk = vocab, chunk
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, weight, targets, lse = ctx.saved_tensors
        (start, real), chunk = ctx.vocab, ctx.chunk  # real None: every column
        grad_rows = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for i in range(0, rows.shape[0], chunk):
            x, t = rows[i : i + chunk], targets[i : i + chunk] - start
            z = F.linear(x, weight).float()  # (c, V_local), recomputed
            probs = (z - lse[i : i + chunk].unsqueeze(-1)).exp_()  # softmax slice
            if real is not None:
                probs[:, real:] = 0.0  # tp padding columns: no token, no gradient
            real = z.shape[-1] if real is None else real
            mine = ((t >= 0) & (t < real)).unsqueeze(-1)  # (c, 1) targets this rank owns
            index = t.clamp(0, z.shape[-1] - 1).unsqueeze(-1)  # (c, 1)
            probs.scatter_add_(-1, index, -mine.to(probs))  # minus the one-hot target
            dz = (probs * grad).to(weight.dtype)  # (c, V_local)
            if grad_rows is not None:
                grad_rows[i : i + chunk] = dz @ weight
            if grad_weight is not None:
                grad_weight += dz.t() @ x
        return grad_rows, grad_weight, None, None, None, None


def target_rows_loss(
    x: Tensor,
    weight: Tensor,
    targets: Tensor,
    fn: ChunkLosses,
    vocab: tuple[int, int | None],
    denom: float | None,
    chunk: int = CHUNK,
) -> Tensor:
    """The loss of head inputs `x` (b, s, h) against `targets` (b, s): the plain
    `loss(head(x), targets, denom)`, computed over the counted rows only, `chunk` at a time.
    `vocab` is (first token, real columns) of `weight`'s rows: (0, None) without tp."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 row, got {chunk}")
    flat = targets.flatten()
    keep = (flat != IGNORE).nonzero().squeeze(1)  # (n,): the rows that have a target
    rows = x.flatten(0, 1).index_select(0, keep)  # (n, h): ignored rows never reach the head
    total = _ChunkedHeadLoss.apply(rows, weight, flat.index_select(0, keep), fn, vocab, chunk)
    return reduce_losses(total, flat, denom)
