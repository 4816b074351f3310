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

`loss_average="micro-batch"` (`--loss-average`) reproduces instead the rule Hugging Face's
Trainer used before transformers PR #34191, for comparison (the finetune lesson): each
micro-batch's loss is the mean over its own targets, averaged over the micro-batches and the
replicas. It is the same mechanism with another divisor, max(own targets, 1) x the replica's
micro-batches, so no runner knows which rule it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from plait.data.sampler import (
    GlobalBatchSampler,
    Rows,
    eval_indices,
    replica_share,
    split_micro,
)
from plait.errors import ConfigError
from plait.models.dropout import sample_keys
from plait.models.loss import IGNORE
from plait.models.packing import Packing

LOSS_AVERAGES = ("tokens", "micro-batch")
"""`tokens`: summed target losses / the global batch's target count (the default, exact);
`micro-batch`: the mean over each micro-batch's own targets, averaged (transformers' old rule)."""


def check_loss_average(value: str) -> None:
    """ConfigError naming `value` unless it is one of LOSS_AVERAGES."""
    if value not in LOSS_AVERAGES:
        raise ConfigError(f"loss_average must be one of {', '.join(LOSS_AVERAGES)}; got {value!r}")


@dataclass
class MicroBatch:
    """One micro-batch as every stage sees it (tokens used by stage 0, targets by the last)."""

    tokens: Tensor  # (b, s)
    targets: Tensor  # (b, s), IGNORE where a token is no target
    keys: Tensor  # (b,) dropout keys
    # (b, s) packed rows' example ids; None: plain causal; a context-parallel rank's
    # ContextPacking (context_batches.py), which the model takes as it is (models/packing.py)
    segments: Tensor | Packing | None = None
    denom: float | None = None  # the loss's divisor (models/loss.py); None: the mean
    # A whole micro-batch of naive DP under loss_average "micro-batch": each replica share's
    # divisor, in share order (the shares' divisors differ); None: `denom` for every row.
    share_denoms: tuple[float, ...] | None = None


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
        loss_average: str = "tokens",
    ) -> None:
        """`replica`: (dp rank, dp size); every tp and pp peer of a replica draws alike.
        `loss_average`: which divisor the micro-batches carry (module doc)."""
        check_loss_average(loss_average)
        self.loss_average = loss_average
        self.corpus, self.global_batch, self.micro_batch = corpus, global_batch, micro_batch
        self.seed, self.replica, self.device = seed, replica, device
        self.sampler = GlobalBatchSampler(len(corpus.train), global_batch, seed)
        self._before: dict[int, dict[str, int]] = {}  # step -> sampler state before its draw
        self._targets: dict[int, int] = {}  # step -> its global batch's target tokens

    def draw(self, step: int) -> list[MicroBatch]:
        """Step `step`'s micro-batches; steps must be drawn in order (the sampler advances)."""
        indices = self._next(step)
        idx, keys = self._share(indices, step, self.replica[0])
        denoms = self._denoms(indices, idx, whole=False)
        train = self.corpus.train
        return [self._micro(train, *a) for a in zip(idx, keys, denoms, strict=True)]

    def draw_whole(self, step: int) -> list[MicroBatch]:
        """Step `step`'s micro-batches of the whole global batch, for a rank that hands the
        replicas their shares (naive data parallelism): micro-batch i holds every replica's
        micro-batch i, replica after replica, so splitting it dp ways gives each replica
        exactly what `draw` gives it. Every rank calls it, so the sampler advances alike.
        The divisors are `draw`'s times dp: the coordinator sums, not averages, the
        replicas' gradients (`denom` the global batch's whole count; under "micro-batch" the
        shares' divisors differ and go in `share_denoms`)."""
        indices = self._next(step)
        dp = self.replica[1]
        shares = [self._share(indices, step, r) for r in range(dp)]
        denoms = [self._denoms(indices, idx, whole=True) for idx, _ in shares]
        micro = []
        for i in range(len(shares[0][0])):
            mb = self._micro(
                self.corpus.train,
                torch.cat([idx[i] for idx, _ in shares]),
                torch.cat([keys[i] for _, keys in shares]),
                denoms[0][i],
            )
            if self.loss_average != "tokens":
                mb.denom, mb.share_denoms = None, tuple(d[i] for d in denoms)
            micro.append(mb)
        return micro

    def _denoms(self, indices: Tensor, micro: list[Tensor], whole: bool) -> list[float]:
        """The divisor of each of a replica's micro-batches `micro` (of the global batch
        `indices`), such that their summed losses averaged over dp is the step's loss:
        tokens: the global count N / dp for every one (the average gives sum / N);
        micro-batch: its own count x len(micro) (the average gives the mean of the means).
        `whole` (naive DP sums the replicas): dp times that. Counts are at least 1: a batch
        without targets has loss 0, not 0/0."""
        rows, dp = self.corpus.train, self.replica[1]
        if self.loss_average == "tokens":
            n = float(max(rows.target_count(indices), 1))
            return [n if whole else n / dp] * len(micro)
        scale = len(micro) * (dp if whole else 1)
        return [float(max(rows.target_count(m), 1) * scale) for m in micro]

    def _next(self, step: int) -> Tensor:
        """The next global batch, remembering where the sampler stood before it."""
        self._before = {k: v for k, v in self._before.items() if k >= step - 3}
        self._targets = {k: v for k, v in self._targets.items() if k >= step - 3}
        self._before[step] = self.sampler.state_dict()
        indices = self.sampler.next_batch()
        self._targets[step] = self.corpus.train.target_count(indices)
        return indices

    def target_tokens(self, step: int) -> int | None:
        """The target tokens of step `step`'s whole global batch (None unless drawn in the
        last few steps): what the summary's target tokens per second count."""
        return self._targets.get(step)

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
        """This replica's share of `batches` global batches of fixed validation windows.

        Fewer rows than asked for (a small validation set, `plait eval` over every row) split
        unevenly over the replicas; a replica left with fewer micro-batches than the first
        (the largest share) gets micro-batches of one row without targets, so that every
        replica runs as many forwards (one left with no row at all, too): ZeRO-3 gathers each
        layer's parameters over dp in every forward, and a replica that stopped early would
        leave the others waiting.
        They add nothing to the loss or the count."""
        val = self.corpus.val
        idx = eval_indices(len(val), batches * self.global_batch)
        rank, size = self.replica
        shares = torch.tensor_split(idx, size)  # the first share is the largest
        zeros = torch.zeros(self.micro_batch, dtype=torch.int64)
        out = [self._micro(val, chunk, zeros[: len(chunk)])
               for chunk in torch.split(shares[rank], self.micro_batch) if len(chunk)]  # fmt: skip
        while len(out) < -(-len(shares[0]) // self.micro_batch):
            out.append(self._no_targets(self._micro(val, idx[:1], zeros[:1])))
        return out

    @staticmethod
    def _no_targets(mb: MicroBatch) -> MicroBatch:
        """`mb` with every target IGNORE, in a new tensor: a window's targets may share
        storage with its tokens (one slice of the stream, shifted by one)."""
        return replace(mb, targets=torch.full_like(mb.targets, IGNORE))

    def _micro(
        self, rows: Rows, idx: Tensor, keys: Tensor, denom: float | None = None
    ) -> MicroBatch:
        """Validation leaves `denom` None: evaluation sums the losses and counts itself."""
        x, y, seg = rows.draw(idx)
        seg = None if seg is None else seg.to(self.device)
        return MicroBatch(x.to(self.device), y.to(self.device), keys.to(self.device), seg, denom)
