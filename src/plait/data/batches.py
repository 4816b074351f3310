"""A step's micro-batches for this replica, drawn the same way by every runner.

Plain accumulation, a pipeline schedule and the 2BW stream all take their micro-batches from
here, so the rule that makes every layout see the single process's data is written once:
every rank draws the same global batch from the seeded sampler, keeps its replica's
contiguous share, and keys dropout by the sample's position in the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from plait.data.sampler import (
    GlobalBatchSampler,
    TokenWindows,
    eval_indices,
    replica_share,
    split_micro,
)
from plait.models.dropout import sample_keys


@dataclass
class MicroBatch:
    """One micro-batch as every stage sees it (tokens used by stage 0, targets by the last)."""

    tokens: Tensor  # (b, s)
    targets: Tensor  # (b, s)
    keys: Tensor  # (b,) dropout keys


@dataclass
class Corpus:
    """Training and validation windows plus the baseline the model must beat."""

    train: TokenWindows
    val: TokenWindows
    unigram_baseline: float


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
        idx, keys = self._share(self._next(step), step, self.replica[0])
        return [self._micro(self.corpus.train, i, k) for i, k in zip(idx, keys, strict=True)]

    def draw_whole(self, step: int) -> list[MicroBatch]:
        """Step `step`'s micro-batches of the whole global batch, for a rank that hands the
        replicas their shares (naive data parallelism): micro-batch i holds every replica's
        micro-batch i, replica after replica, so splitting it dp ways gives each replica
        exactly what `draw` gives it. Every rank calls it, so the sampler advances alike."""
        indices = self._next(step)
        shares = [self._share(indices, step, r) for r in range(self.replica[1])]
        return [
            self._micro(
                self.corpus.train,
                torch.cat([idx[i] for idx, _ in shares]),
                torch.cat([keys[i] for _, keys in shares]),
            )
            for i in range(len(shares[0][0]))
        ]

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

    def _micro(self, windows: TokenWindows, idx: Tensor, keys: Tensor) -> MicroBatch:
        x, y = (v.to(self.device) for v in windows.batch(idx))
        return MicroBatch(x, y, keys.to(self.device))
