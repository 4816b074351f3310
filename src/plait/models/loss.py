"""The language-model loss and its ignore rule: the one home of IGNORE.

A target equal to IGNORE (-100, the value Hugging Face and PyTorch use) is no target: it adds
nothing to the loss and gets no gradient (a prompt token, a pad). The loss of a micro-batch is
the sum of its targets' cross entropies divided by `denom`, the number of target tokens of
the whole global batch divided by the data-parallel size (`data/batches.py` computes it from
the rows drawn, before the step): summed over micro-batches and averaged over replicas it is
the global token-weighted mean, whatever the layout, and needs no collective for the count.
Averaging per micro-batch instead weighs a micro-batch with few targets as much as one with
many, which is the gradient-accumulation bug of transformers before PR #34191.

How a packed row's loss stays exact across data-parallel ranks, in the order a step meets it:

1. The row: an examples folder's rows hold several examples each (`data/packing.py` picks
   which, from the index's lengths; `data/examples.py` draws them), with prompt tokens and
   pads IGNORE (`data/instruct.py` says where targets begin and end). Positions restart and
   attention stays inside each example (`models/packing.py`, `models/packed_attention.py`),
   so a row computes what its examples compute one by one.
2. The count: every rank draws the indices of the whole global batch (`data/sampler.py`) and
   counts its targets from the index (`Rows.target_count`), without reading a token or a
   collective; `data/batches.py` gives each of its replica's micro-batches `denom` = that
   count / dp.
3. The loss: each micro-batch's summed target loss / `denom` (here; the vocabulary-parallel
   head's loss keeps the same rule, parallel/tp/vocab.py; a pipeline's last stage computes
   it, parallel/pipeline/walker.py), backpropagated as it is and summed over micro-batches.
4. The reduction: the data-parallel gradient reduction averages over dp
   (`parallel/zero/reducer.py`; 2BW's `parallel/pipeline/weight_versions.py` alike), so the
   gradient is that of sum / count over the whole global batch, the single process's; naive
   data parallelism sums instead, and its micro-batches carry the whole count. The reported
   loss is averaged over dp the same way (`step.py`).

tests/test_exact_loss.py shows it on packed, masked rows of random lengths in every layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE = -100


def target_count(targets: Tensor) -> Tensor:
    """How many of `targets` count (are not IGNORE), as a 0-d tensor on their device: summing
    it into a running total costs no host synchronization."""
    return (targets != IGNORE).sum()


def reduce_losses(losses: Tensor, targets: Tensor, denom: float | None) -> Tensor:
    """Per-token losses (n,) -> the summed loss / `denom`; with `denom` None the mean over
    the counted targets, 0.0 (not NaN) when none counts. Ignored tokens must already hold 0."""
    if denom is not None:
        return losses.sum() / denom
    count = (targets != IGNORE).sum()
    return losses.sum() / count.clamp(min=1)


class LMLoss(nn.Module):
    """Token cross entropy in fp32 with the ignore rule, summed and divided by `denom`.

    A submodule rather than a call inside `Transformer.forward` so that tensor parallelism
    can swap in a vocabulary-parallel loss that reads vocabulary-sharded logits
    (`parallel/tp/vocab.py`, the same rule).
    """

    def forward(self, logits: Tensor, targets: Tensor, denom: float | None = None) -> Tensor:
        flat = targets.flatten()
        losses = self.token_losses(logits.flatten(0, 1), flat)  # (n,), 0 where ignored
        return reduce_losses(losses, flat, denom)

    def token_losses(self, logits: Tensor, targets: Tensor) -> Tensor:
        """(n, V) logits, (n,) targets -> (n,) fp32 losses, 0 where ignored."""
        # fp32 loss: a low-precision log-softmax over a large vocabulary loses digits.
        return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="none")

    @property
    def vocab(self) -> tuple[int, int | None]:
        """(first token, real columns) of the logits this loss reads: all (None) of them."""
        return 0, None

    def chunk_losses(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """The lighter loss's step (models/light_loss.py), without autograd: (c, V) logits
        and (c,) counted targets -> (c,) fp32 losses and the (c,) log-sum-exp."""
        z = logits.float()
        lse = torch.logsumexp(z, dim=-1)
        return lse - z.gather(-1, targets.unsqueeze(-1)).squeeze(-1), lse
