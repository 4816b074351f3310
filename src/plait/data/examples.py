"""Rows of instruction examples for training: packed (or padded) from an examples folder.

How a run uses it (build/corpus.py; when the model consumes segments and IGNORE targets):

    if is_examples_dir(cfg.data.path):          # before workers: the launcher
        check_examples(cfg.data.path, cfg.train.seq_len, cfg.data.val_fraction,
                       cfg.data.pack, cfg.data.long, cfg.train.global_batch, init_from)
    ...
    made = example_corpus(cfg.data.path, cfg.train.seq_len, cfg.data.val_fraction,
                          cfg.data.pack, cfg.data.long)   # in every worker, deterministic
    corpus = Corpus(made.train, made.val, made.baseline); print(made.report) on rank 0

`made.train` and `made.val` are Rows (`data/sampler.py`'s protocol): `seq_len`, `len()`,
`draw(idx)` -> (tokens, targets with IGNORE, segments) int64 (b, seq_len), and
`target_count(idx)`. The
split is `packing.val_split`: an evenly spaced `val_fraction` of the examples, the same ones
for any seq_len; each side is then packed on its own (`packing.assign_rows`), so no row mixes
training and validation examples. Nothing is read up front: tokens and masks are
memory-mapped and a row's examples are read when it is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from plait.data.corpus import unigram_entropy
from plait.data.packing import RowAssignment, assign_rows, dropped_reason, val_split
from plait.data.shards import ShardStream, read_index, shard_tokenizer
from plait.data.tokenizer import resolve_tokenizer
from plait.errors import ConfigError
from plait.models.loss import IGNORE  # a target that contributes nothing to the loss

BASELINE_TARGETS = 1 << 22  # target tokens the unigram baseline is counted on, at most


def is_examples_dir(path: str | Path | None) -> bool:
    """True for a folder `data prepare --format alpaca|chat` wrote."""
    if path is None or not (Path(path) / "index.json").is_file():
        return False
    return read_index(path).get("kind", "text") == "examples"


class ExampleStore:
    """An examples folder, memory-mapped: each example's tokens and target mask."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = read_index(folder)
        if index.get("kind") != "examples":
            raise ConfigError(f"{str(folder)!r} holds text shards, not instruction examples")
        meta = index["examples"]
        self.pad = int(index["tokenizer"]["eos_id"])
        self.tokens = ShardStream(folder)
        self.mask = ShardStream(folder, key="mask", dtype="uint8")
        count = int(meta["count"])
        offsets = self.folder / meta["offsets"]
        if not offsets.is_file() or offsets.stat().st_size != 8 * (count + 1):
            raise ConfigError(f"{str(offsets)!r} is missing or not {8 * (count + 1)} bytes")
        self.offsets = np.memmap(offsets, dtype="<i8", mode="r")
        self.lengths = np.asarray(meta["lengths"], dtype=np.int64)
        self.first_target = np.asarray(meta["first_target"], dtype=np.int64)
        self.targets = np.asarray(meta["targets"], dtype=np.int64)
        self.prompts = np.asarray(meta.get("prompts", meta["first_target"]), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def example(self, i: int, used: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `used` tokens of example i and their target mask (int64 both)."""
        a = int(self.offsets[i])
        return self.tokens.read(a, a + used), self.mask.read(a, a + used)

    def prompt(self, i: int) -> np.ndarray:
        """Example i's prompt: its tokens before its first target (alpaca: Stanford's prompt
        as the tokenizer encodes it; chat: the conversation up to its first assistant turn
        with the generation prompt). Folders from before the index's "prompts" list: the
        tokens before the first target."""
        return self.example(i, int(self.prompts[i]))[0]


def first_val_prompt(folder: str | Path, val_fraction: float) -> tuple[np.ndarray, int]:
    """(tokens, pad id) of the first validation example's prompt (`packing.val_split`): a
    fixed instruction, the same for every run on these examples (the summary's sample)."""
    store = ExampleStore(folder)
    first = int(val_split(len(store), val_fraction)[1][0])
    return store.prompt(first), store.pad


class ExampleRows:
    """Rows of `seq_len` positions, each holding the examples of one packing bin: inputs
    tokens[:-1], targets tokens[1:] where the mask says so (else IGNORE); segment ids count
    the row's examples from 0, and the padding after them is one more segment."""

    def __init__(self, store: ExampleStore, assigned: RowAssignment) -> None:
        self.store, self.assigned, self.seq_len = store, assigned, assigned.seq_len
        kept = store.targets[assigned.example]
        cut = np.flatnonzero(assigned.positions + 1 < store.lengths[assigned.example])
        for p in cut.tolist():  # truncated: count the targets kept
            _, mask = store.example(int(assigned.example[p]), int(assigned.positions[p]) + 1)
            kept[p] = int(mask[1:].sum())
        self._row_targets = np.add.reduceat(kept, assigned.row_start[:-1]) if len(kept) else kept
        self._real = (
            np.add.reduceat(assigned.positions, assigned.row_start[:-1]) if len(kept) else kept
        )

    def __len__(self) -> int:
        return self.assigned.rows

    def target_count(self, idx: Tensor) -> int:
        """Targets that are not IGNORE in rows `idx`: known without reading a token."""
        return int(self._row_targets[np.asarray(idx, dtype=np.int64)].sum())

    def draw(self, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens, targets, segments) of rows `idx`, int64 (b, seq_len) each."""
        rows = np.asarray(idx, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"row indices must lie in 0..{len(self) - 1}, got {rows.tolist()}")
        s = self.seq_len
        tokens = np.full((len(rows), s), self.store.pad, np.int64)
        targets = np.full((len(rows), s), IGNORE, np.int64)
        segments = np.zeros((len(rows), s), np.int64)
        for b, r in enumerate(rows.tolist()):
            at, seg = 0, 0
            for p in range(self.assigned.row_start[r], self.assigned.row_start[r + 1]):
                n = int(self.assigned.positions[p])
                tok, mask = self.store.example(int(self.assigned.example[p]), n + 1)
                tokens[b, at : at + n] = tok[:-1]
                targets[b, at : at + n] = np.where(mask[1:] > 0, tok[1:], IGNORE)
                segments[b, at : at + n] = seg
                at, seg = at + n, seg + 1
            segments[b, at:] = seg  # padding: its own run
        return torch.from_numpy(tokens), torch.from_numpy(targets), torch.from_numpy(segments)

    def counts(self) -> dict[str, float]:
        return {"rows": self.assigned.rows, "truncated": self.assigned.truncated,
                "dropped": self.assigned.dropped, "efficiency": self.assigned.efficiency,
                "target_tokens": int(self._row_targets.sum())}  # fmt: skip


@dataclass
class ExampleCorpus:
    """What a run needs (build/corpus.py): training and validation Rows, baseline, report."""

    train: ExampleRows
    val: ExampleRows
    baseline: float
    report: str


def _assignments(store: ExampleStore, seq_len: int, val_fraction: float, pack: bool, long: str,
           held: ExampleStore | None = None) -> tuple[RowAssignment, RowAssignment]:  # fmt: skip
    """(training, validation) row assignments: the split of `store`, or with a separate validation
    set `held` (`--eval-data`) every example of each."""
    if held is not None:
        return tuple(
            assign_rows(np.arange(len(s), dtype=np.int64), s.lengths, s.first_target, seq_len,
                      pack, long)
            for s in (store, held)
        )  # fmt: skip
    train_ids, val_ids = val_split(len(store), val_fraction)
    return tuple(
        assign_rows(ids, store.lengths[ids], store.first_target[ids], seq_len, pack, long)
        for ids in (train_ids, val_ids)
    )


def target_baseline(store: ExampleStore, assigned: RowAssignment) -> float:
    """Unigram entropy (nats) of the training rows' target tokens, on at most
    BASELINE_TARGETS of them: what a model that ignores context scores on the targets."""
    seen: list[np.ndarray] = []
    total = 0
    for e, n in zip(assigned.example.tolist(), assigned.positions.tolist(), strict=True):
        tok, mask = store.example(e, n + 1)
        seen.append(tok[1:][mask[1:] > 0])
        total += len(seen[-1])
        if total >= BASELINE_TARGETS:
            break
    return unigram_entropy(np.concatenate(seen)) if total else 0.0


def example_corpus(
    folder: str | Path, seq_len: int, val_fraction: float, pack: bool = True,
    long: str = "truncate", eval_folder: str | Path | None = None,
) -> ExampleCorpus:  # fmt: skip
    """Training and validation rows of an examples folder for `seq_len` (deterministic: every
    rank builds the same), the target baseline and the line `train` prints; validation from
    `eval_folder` (every example of it) when given, else held out of `folder`."""
    store = ExampleStore(folder)
    held = ExampleStore(eval_folder) if eval_folder is not None else None
    train_rows, val_rows = _assignments(store, seq_len, val_fraction, pack, long, held)
    train, val = ExampleRows(store, train_rows), ExampleRows(held or store, val_rows)
    t, v = train.counts(), val.counts()
    count = f"{len(store):,}" + (f" + {len(held):,} --eval-data" if held is not None else "")
    report = (
        f"{'packed' if pack else 'padded'} {count} examples into {t['rows']:,} training "
        f"and {v['rows']:,} validation rows of {seq_len}: {t['truncated'] + v['truncated']:,} "
        f"truncated, {t['dropped'] + v['dropped']:,} dropped, packing efficiency "
        f"{t['efficiency']:.1%}, {t['target_tokens']:,} training target tokens"
    )
    return ExampleCorpus(train, val, target_baseline(store, train_rows), report)


def check_examples(
    folder: str | Path, seq_len: int, val_fraction: float, pack: bool, long: str,
    global_batch: int, init_from: str | None = None, eval_folder: str | None = None,
) -> tuple[int, int]:  # fmt: skip
    """The launcher's check of an examples folder for a run, from the index alone (no token
    read): the tokenizer agrees with `--init-from`'s, no prompt alone fills the row under
    truncate, and there are rows for one global batch and a validation (of `eval_folder`,
    every example, when given). Returns the (training, validation) row counts; ConfigError
    names the first problem."""
    if init_from and (Path(init_from) / "tokenizer.json").is_file():
        try:
            shard_tokenizer(folder, resolve_tokenizer(init_from))
        except ConfigError:
            made = read_index(folder)["tokenizer"]
            raise ConfigError(
                f"examples {str(folder)!r} were made with tokenizer {made['path']} (sha256 "
                f"{made['sha256']}), not with --init-from {init_from}'s; prepare them again "
                f"with --tokenizer {init_from}"
            ) from None
    lengths, first = _index_lengths(folder)
    if eval_folder is None:
        train_ids, val_ids = val_split(len(lengths), val_fraction)
        train, val = (assign_rows(ids, lengths[ids], first[ids], seq_len, pack, long).rows
                      for ids in (train_ids, val_ids))  # fmt: skip
    else:
        train = assign_rows(np.arange(len(lengths)), lengths, first, seq_len, pack, long).rows
        held, held_first = _index_lengths(eval_folder)
        val = assign_rows(np.arange(len(held)), held, held_first, seq_len, pack, long).rows
    if train < global_batch or val < 1:
        where = f" (--eval-data {eval_folder})" if eval_folder is not None else ""
        cause = dropped_reason(lengths, seq_len, long)
        if train == val == 0 and cause:
            raise ConfigError(f"examples {str(folder)!r}: {cause}")
        raise ConfigError(
            f"examples {str(folder)!r} give {train} training and {val} validation rows{where} of "
            f"seq_len {seq_len} ({'packed' if pack else 'one example a row'}, long={long}), "
            f"but one global batch needs {global_batch} and validation at least 1"
            + (f" ({cause})" if cause else "")
        )
    return train, val


def _index_lengths(folder: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """An examples folder's lengths and first targets, from its index alone."""
    meta = read_index(folder)["examples"]
    return (np.asarray(meta["lengths"], dtype=np.int64),
            np.asarray(meta["first_target"], dtype=np.int64))  # fmt: skip
