"""A step's micro-batches for this replica, drawn the same way by every runner.

Plain accumulation, a pipeline schedule and the 2BW stream all take their micro-batches from
here, so the rule that makes every layout see the single process's data is written once:
every rank draws the same global batch from the seeded sampler, keeps its replica's
contiguous share, and keys dropout by the sample's position in the global batch.

The loss rule is written here too (models/loss.py): each micro-batch carries `denom`, the
target tokens of the whole global batch divided by dp (every rank drew the whole batch's
indices, so it counts them without a collective); a micro-batch's loss is its summed target
loss / denom, so the sum over micro-batches, averaged over replicas, is the global
token-weighted mean in every layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from plait.data.sampler import (
    GlobalBatchSampler,
    Rows,
    eval_indices,
    replica_share,
    split_micro,
)
from plait.models.dropout import sample_keys


@dataclass
class MicroBatch:
    """One micro-batch as every stage sees it (tokens used by stage 0, targets by the last)."""

    tokens: Tensor  # (b, s)
    targets: Tensor  # (b, s), IGNORE where a token is no target
    keys: Tensor  # (b,) dropout keys
    segments: Tensor | None = None  # (b, s) packed rows' example ids; None: plain causal
    denom: float | None = None  # the loss's divisor (models/loss.py); None: the mean


@dataclass
class Corpus:
    """Training and validation windows plus the baseline the model must beat."""

    train: Rows
    val: Rows
    unigram_baseline: float
    report: str = ""  # what `train` says about the rows (instruction data: packing)


class StepBatches:
    """Draws each step's micro-batches (and the fixed validation set) for one replica."""

    def __init__(
        self,
        corpus: Corpus,
        global_batch: int,
        micro_batch: int,
        seed: int,
        replica: tuple[int, int],
        device: torch.device,
    ) -> None:
        """`replica`: (dp rank, dp size); every tp and pp peer of a replica draws alike."""
        self.corpus, self.global_batch, self.micro_batch = corpus, global_batch, micro_batch
        self.seed, self.replica, self.device = seed, replica, device
        self.sampler = GlobalBatchSampler(len(corpus.train), global_batch, seed)
        self._before: dict[int, dict[str, int]] = {}  # step -> sampler state before its draw

    def draw(self, step: int) -> list[MicroBatch]:
        """Step `step`'s micro-batches; steps must be drawn in order (the sampler advances)."""
        indices = self._next(step)
        denom = self._denom(indices) / self.replica[1]  # dp's average then gives the sum / N
        idx, keys = self._share(indices, step, self.replica[0])
        train = self.corpus.train
        return [self._micro(train, i, k, denom) for i, k in zip(idx, keys, strict=True)]

    def draw_whole(self, step: int) -> list[MicroBatch]:
        """Step `step`'s micro-batches of the whole global batch, for a rank that hands the
        replicas their shares (naive data parallelism): micro-batch i holds every replica's
        micro-batch i, replica after replica, so splitting it dp ways gives each replica
        exactly what `draw` gives it. Every rank calls it, so the sampler advances alike.
        `denom` is the global batch's whole count: the coordinator sums, not averages, the
        replicas' gradients."""
        indices = self._next(step)
        denom = self._denom(indices)
        shares = [self._share(indices, step, r) for r in range(self.replica[1])]
        return [
            self._micro(
                self.corpus.train,
                torch.cat([idx[i] for idx, _ in shares]),
                torch.cat([keys[i] for _, keys in shares]),
                denom,
            )
            for i in range(len(shares[0][0]))
        ]

    def _denom(self, indices: Tensor) -> float:
        """Target tokens of the global batch `indices` (at least 1: a batch without targets
        has loss 0, not 0/0)."""
        return float(max(self.corpus.train.target_count(indices), 1))

    def _next(self, step: int) -> Tensor:
        """The next global batch, remembering where the sampler stood before it."""
        self._before = {k: v for k, v in self._before.items() if k >= step - 3}
        self._before[step] = self.sampler.state_dict()
        return self.sampler.next_batch()

    def _share(self, indices: Tensor, step: int, dp_rank: int) -> tuple[list, list]:
        """Replica `dp_rank`'s micro-batches of window indices and dropout keys."""
        share, positions = replica_share(indices, dp_rank, self.replica[1])
        keys = sample_keys(self.seed, step, positions)
        return split_micro(share, self.micro_batch), split_micro(keys, self.micro_batch)

    def position(self, step: int) -> dict[str, int]:
        """The sampler state a run resumed at `step` starts from: the state before step
        `step` was drawn (the 2BW stream draws a step ahead of the one it updates)."""
        return self._before.get(step) or self.sampler.state_dict()

    def validation(self, batches: int) -> list[MicroBatch]:
        """This replica's share of `batches` global batches of fixed validation windows."""
        val = self.corpus.val
        idx = eval_indices(len(val), batches * self.global_batch)
        rank, size = self.replica
        mine = torch.tensor_split(idx, size)[rank]
        return [
            self._micro(val, chunk, torch.zeros(len(chunk), dtype=torch.int64))
            for chunk in torch.split(mine, self.micro_batch)
        ]

    def _micro(
        self, rows: Rows, idx: Tensor, keys: Tensor, denom: float | None = None
    ) -> MicroBatch:
        """Validation leaves `denom` None: evaluation sums the losses and counts itself."""
        x, y, seg = rows.draw(idx)
        seg = None if seg is None else seg.to(self.device)
        return MicroBatch(x.to(self.device), y.to(self.device), keys.to(self.device), seg, denom)
