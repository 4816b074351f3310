"""An in-memory `Rows` (plait.data.sampler) of packed, masked, variable-length examples.

The data instruction fine-tuning gives the model, made up: each row holds examples of random
lengths, back to back (segment ids 0, 1, 2, ...), each with a random prompt whose targets are
IGNORE, and a final padding run with IGNORE targets; some rows have no target at all. The
exact-loss tests train every layout on it and compare with one process.
"""

from __future__ import annotations

import torch

from plait.config import Config
from plait.data.batches import Corpus
from plait.models.loss import IGNORE


class PackedRows:
    """`rows` rows of `seq_len` tokens drawn from `vocab`, made from `seed`."""

    def __init__(self, rows: int, seq_len: int, vocab: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.seq_len = seq_len
        self.tokens = torch.randint(0, vocab, (rows, seq_len), generator=gen)
        self.targets = torch.randint(0, vocab, (rows, seq_len), generator=gen)
        self.segments = torch.zeros(rows, seq_len, dtype=torch.int64)
        for r in range(rows):
            self._pack(r, gen)

    def _pack(self, r: int, gen: torch.Generator) -> None:
        """Examples of 2..seq_len/2 tokens until less than 2 are left, then a padding run."""
        at, example, s = 0, 0, self.seq_len
        no_targets = int(torch.randint(0, 4, (1,), generator=gen)) == 0  # about a quarter
        while s - at >= 2:
            length = int(torch.randint(2, max(3, s // 2 + 1), (1,), generator=gen))
            if at + length > s or int(torch.randint(0, 5, (1,), generator=gen)) == 0:
                break  # the rest is padding (sometimes early: rows of different fill)
            prompt = int(torch.randint(0, length, (1,), generator=gen))
            self.segments[r, at : at + length] = example
            self.targets[r, at : at + prompt] = IGNORE
            at, example = at + length, example + 1
        self.segments[r, at:] = example  # padding: a run of its own, no targets
        self.targets[r, at:] = IGNORE
        if no_targets:
            self.targets[r] = IGNORE

    def __len__(self) -> int:
        return len(self.tokens)

    def draw(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tokens[idx], self.targets[idx], self.segments[idx]

    def target_count(self, idx: torch.Tensor) -> int:
        return int((self.targets[idx] != IGNORE).sum())


def packed_corpus(cfg: Config) -> Corpus:
    """Training and validation rows of `cfg`'s sequence length and vocabulary."""
    s, v = cfg.train.seq_len, cfg.model.vocab_size
    return Corpus(PackedRows(64, s, v, seed=11), PackedRows(16, s, v, seed=12), 0.0)
