"""Packing examples into rows: best-fit decreasing's properties (every example once, no row
over seq_len, no bin could have taken a later item that fits better), determinism, padding
with --no-pack, truncate and drop, the validation split, and rows read back from shards
(inputs, IGNORE targets, segments) against the examples they hold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from instruct_data import LLAMA_TEMPLATE, tokenizer_folder, write_jsonl
from plait.data.examples import (
    IGNORE,
    ExampleRows,
    ExampleStore,
    check_examples,
    example_corpus,
    is_examples_dir,
)
from plait.data.instruct import InstructJob, prepare_examples
from plait.data.packing import assign_rows, best_fit_decreasing, fit, val_split
from plait.errors import ConfigError


def _lengths(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(2, 60, n)


def test_bfd_places_every_item_once_and_never_overflows() -> None:
    sizes = _lengths(500) - 1
    bins = best_fit_decreasing(sizes, 64)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(sizes)))
    assert all(sizes[b].sum() <= 64 for b in bins)
    # any-fit: a bin was opened only because its first item fit in no earlier bin, and rooms
    # only shrink, so no earlier bin's final room holds a later bin's first item
    rooms = [64 - int(sizes[b].sum()) for b in bins]
    for later, b in enumerate(bins):
        assert all(rooms[k] < sizes[b[0]] for k in range(later))
    # decreasing: each bin's items in non-increasing size
    assert all(list(sizes[b]) == sorted(sizes[b], reverse=True) for b in bins)
    assert bins == best_fit_decreasing(sizes.copy(), 64)  # deterministic


def test_bfd_picks_the_tightest_bin() -> None:
    # decreasing: 7, 6, 4, 3 into 10: 7 -> bin0 (room 3), 6 -> bin1 (room 4), 4 -> bin1
    # (the only room >= 4), 3 -> bin0 (room 3, tightest), not a new bin
    assert best_fit_decreasing(np.array([3, 7, 4, 6]), 10) == [[1, 0], [3, 2]]
    # ties: equal sizes go in index order
    assert best_fit_decreasing(np.array([5, 5, 5]), 10) == [[0, 1], [2]]


def test_fit_truncates_or_drops_long_examples() -> None:
    ids, lengths, first = np.arange(4), np.array([5, 12, 9, 30]), np.array([2, 3, 1, 4])
    kept, pos, truncated, dropped = fit(ids, lengths, first, 8, "truncate")
    assert kept.tolist() == [0, 1, 2, 3] and pos.tolist() == [4, 8, 8, 8]
    assert (truncated, dropped) == (2, 0)  # 9 tokens fill 8 positions exactly
    kept, pos, truncated, dropped = fit(ids, lengths, first, 8, "drop")
    assert kept.tolist() == [0, 2] and pos.tolist() == [4, 8] and (truncated, dropped) == (0, 2)
    with pytest.raises(ConfigError, match=r"^example 1 has 12 tokens and its first target at "
                       r"token 10, beyond seq_len 8 .*use --long drop"):  # fmt: skip
        fit(ids, lengths, np.array([2, 10, 1, 4]), 8, "truncate")
    with pytest.raises(ConfigError, match="long must be one of truncate, drop; got 'cut'"):
        fit(ids, lengths, first, 8, "cut")


def test_no_pack_is_one_example_a_row_and_efficiency_counts_padding() -> None:
    lengths = np.array([5, 9, 3])
    assigned = assign_rows(np.arange(3), lengths, np.ones(3, np.int64), 8, False, "truncate")
    assert assigned.rows == 3 and assigned.example.tolist() == [0, 1, 2]
    assert assigned.efficiency == pytest.approx((4 + 8 + 2) / 24)
    packed = assign_rows(np.arange(3), lengths, np.ones(3, np.int64), 8, True, "truncate")
    assert packed.rows == 2 and packed.efficiency == pytest.approx(14 / 16)


def test_val_split_is_spread_and_independent_of_seq_len() -> None:
    train, val = val_split(100, 0.05)
    assert val.tolist() == [0, 20, 40, 60, 80]
    assert sorted([*train.tolist(), *val.tolist()]) == list(range(100))
    assert val_split(3, 0.01)[1].tolist() == [0]  # at least one
    with pytest.raises(ConfigError, match="1 example"):
        val_split(1, 0.5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pack")
    tok = tokenizer_folder(root / "tok", LLAMA_TEMPLATE)
    rng = np.random.default_rng(1)
    words = ["fox", "dog", "jumps", "over", "the", "lazy", "quick", "brown", "numbers"]
    rows = [
        {"instruction": " ".join(rng.choice(words, rng.integers(1, 6))), "input": "",
         "output": " ".join(rng.choice(words, rng.integers(1, 40)))}
        for _ in range(60)
    ]  # fmt: skip
    data = write_jsonl(root / "a.jsonl", rows)
    prepare_examples(InstructJob(str(data), root / "sft", "alpaca", str(tok), shard_tokens=97))
    return root / "sft"


def _check_rows(rows: ExampleRows, store: ExampleStore) -> set[int]:
    """Every row against its examples read directly; returns the examples seen."""
    seen: set[int] = set()
    idx = torch.arange(len(rows))
    tokens, targets, segments = rows.draw(idx)
    assert tokens.shape == targets.shape == segments.shape == (len(rows), rows.seq_len)
    assert rows.target_count(idx) == int((targets != IGNORE).sum())
    assigned = rows.assigned
    for r in range(len(rows)):
        at = 0
        for seg, p in enumerate(range(assigned.row_start[r], assigned.row_start[r + 1])):
            e, n = int(assigned.example[p]), int(assigned.positions[p])
            a = int(store.offsets[e])
            tok = store.tokens.read(a, a + n + 1)
            mask = store.mask.read(a, a + n + 1)
            assert tokens[r, at : at + n].tolist() == tok[:-1].tolist()
            want = np.where(mask[1:] > 0, tok[1:], IGNORE)
            assert targets[r, at : at + n].tolist() == want.tolist()
            assert (segments[r, at : at + n] == seg).all()
            seen.add(e)
            at += n
        assert (targets[r, at:] == IGNORE).all()
        if at < rows.seq_len:
            assert (segments[r, at:] == seg + 1).all()  # padding is its own run
    return seen


@pytest.mark.parametrize("pack", [True, False])
def test_rows_hold_each_example_once_with_exact_targets(folder, pack) -> None:
    store = ExampleStore(folder)
    made = example_corpus(folder, 64, 0.1, pack, "truncate")
    seen_train = _check_rows(made.train, store)
    seen_val = _check_rows(made.val, store)
    assert seen_train.isdisjoint(seen_val) and len(seen_train | seen_val) == len(store)
    assert made.baseline > 0
    assert ("packed" if pack else "padded") in made.report and "rows of 64" in made.report
    again = example_corpus(folder, 64, 0.1, pack, "truncate")
    assert np.array_equal(again.train.assigned.example, made.train.assigned.example)
    if not pack:
        assert len(made.train) == len(seen_train)


def test_packing_beats_padding_and_drop_loses_examples(folder) -> None:
    packed = example_corpus(folder, 200, 0.1, True, "truncate").train.counts()
    padded = example_corpus(folder, 200, 0.1, False, "truncate").train.counts()
    assert packed["rows"] < padded["rows"] and packed["efficiency"] > padded["efficiency"]
    assert packed["target_tokens"] == padded["target_tokens"]
    packed = example_corpus(folder, 64, 0.1, True, "truncate").train.counts()
    assert packed["truncated"] > 0
    dropped = example_corpus(folder, 64, 0.1, True, "drop").train.counts()
    assert dropped["dropped"] == packed["truncated"] and dropped["truncated"] == 0
    assert dropped["target_tokens"] < packed["target_tokens"]


def test_check_examples_from_the_index(folder, tmp_path) -> None:
    train, val = check_examples(folder, 64, 0.1, True, "truncate", 2)
    made = example_corpus(folder, 64, 0.1, True, "truncate")
    assert (train, val) == (len(made.train), len(made.val))
    with pytest.raises(ConfigError, match=r"give \d+ training and \d+ validation rows of seq_len "
                       r"64 .* needs 10000"):  # fmt: skip
        check_examples(folder, 64, 0.1, True, "truncate", 10000)
    with pytest.raises(ConfigError, match=r"first target at token \d+, beyond seq_len 4"):
        check_examples(folder, 4, 0.1, True, "truncate", 1)
    other = tokenizer_folder(tmp_path / "other", None)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + " ")
    with pytest.raises(ConfigError, match=r"not with --init-from .*other's; prepare them again"):
        check_examples(folder, 64, 0.1, True, "truncate", 1, str(other))


def test_text_shards_are_not_examples(tmp_path) -> None:
    from plait.data.prepare import PrepareJob, prepare

    text = tmp_path / "t.txt"
    text.write_text("plain text, as before\n" * 20)
    prepare(PrepareJob(str(text), tmp_path / "shards"))
    assert not is_examples_dir(tmp_path / "shards") and not is_examples_dir(None)
    with pytest.raises(ConfigError, match="holds text shards, not instruction examples"):
        ExampleStore(tmp_path / "shards")


def test_examples_dir_is_recognised(folder) -> None:
    assert is_examples_dir(folder)
    with pytest.raises(IndexError, match="row indices must lie in"):
        example_corpus(folder, 64, 0.1).train.draw(torch.tensor([10_000]))
