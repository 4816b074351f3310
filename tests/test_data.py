"""Tests for plait.data: corpus discovery, tokenizer, windows and the global-batch sampler."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.data import (
    ByteTokenizer,
    GlobalBatchSampler,
    TokenWindows,
    corpus_bytes_available,
    corpus_files,
    default_corpus_dir,
    eval_indices,
    load_tokens,
    replica_share,
    split_micro,
    unigram_entropy,
)
from plait.errors import ConfigError


def test_tokenizer_round_trip_including_non_ascii() -> None:
    tok = ByteTokenizer()
    text = "plain ascii, naïve café, 日本語, emoji 🙂\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.decode(torch.from_numpy(ids.copy())) == text
    assert tok.decode(list(ids)) == text
    # A window cut in the middle of a character decodes with a replacement, not an error.
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"


@pytest.fixture
def user_folder(tmp_path: Path) -> Path:
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.txt").write_text("ay")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.md").write_text("zed")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_text("see")
    (tmp_path / ".hidden.txt").write_text("secret")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("no")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "c.txt").write_text("cache")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "pkg.py").write_text("third party")
    (tmp_path / "blob.bin").write_bytes(b"\x89PNG\x00\x01\x02")
    (tmp_path / "late_nul.txt").write_bytes(b"x" * 5000 + b"\x00")  # NUL past the probe
    (tmp_path / "empty.txt").write_bytes(b"")
    return tmp_path


def test_corpus_files_order_and_skipping(user_folder: Path) -> None:
    files = corpus_files(user_folder)
    rel = [f.relative_to(user_folder).as_posix() for f in files]
    assert rel == ["a/z.md", "a.txt", "b.txt", "late_nul.txt", "sub/c.py"]
    assert files == sorted(files, key=lambda f: f.relative_to(user_folder).parts)
    assert corpus_files(user_folder / "b.txt") == [user_folder / "b.txt"]


def test_load_tokens_user_folder_joins_with_newlines(user_folder: Path) -> None:
    (user_folder / "late_nul.txt").unlink()
    tokens = load_tokens(str(user_folder), max_bytes=1000)
    assert tokens.tobytes() == b"zed\nay\nbee\nsee"
    assert load_tokens(str(user_folder), max_bytes=5).tobytes() == b"zed\na"
    # Never ends on a bare separator: stop before a file when only "\n" would fit.
    assert load_tokens(str(user_folder), max_bytes=4).tobytes() == b"zed"
    # Sizes only: the binary file is counted, so the estimate errs high, never low.
    assert corpus_bytes_available(str(user_folder), 1000) >= len(tokens)
    (user_folder / "blob.bin").unlink()
    assert corpus_bytes_available(str(user_folder), 1000) == len(tokens)
    assert corpus_bytes_available(str(user_folder), 5) == 5


def test_default_corpus_loads_deterministically_within_budget() -> None:
    assert default_corpus_dir().is_dir()
    files = corpus_files(default_corpus_dir())
    assert files and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "__pycache__" in f.parts for f in files)
    a = load_tokens(None, max_bytes=200_000)
    b = load_tokens(None, max_bytes=200_000)
    assert a.dtype == np.uint8 and len(a) == 200_000
    assert np.array_equal(a, b)
    assert np.array_equal(load_tokens(None, max_bytes=1000), a[:1000])
    assert corpus_bytes_available(None, 200_000) == 200_000
    assert a.flags.writeable


def test_missing_and_empty_paths_are_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=r"nope.*does not exist"):
        load_tokens(str(missing), 100)
    with pytest.raises(ConfigError, match=r"nope"):
        corpus_files(missing)
    with pytest.raises(ConfigError, match=r"nope"):
        corpus_bytes_available(str(missing), 100)
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    (empty / "only_binary").write_bytes(b"\x00\x01")
    with pytest.raises(ConfigError, match=r"empty_dir.*no readable text"):
        load_tokens(str(empty), 100)
    with pytest.raises(ConfigError, match=r"max_bytes.*0"):
        load_tokens(None, 0)


def test_unigram_entropy_known_distributions() -> None:
    assert unigram_entropy(np.array([0, 1, 2, 3] * 25, dtype=np.uint8)) == pytest.approx(
        math.log(4)
    )
    assert unigram_entropy(np.full(10, 7, dtype=np.uint8)) == 0.0
    # p = (3/4, 1/4)
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert unigram_entropy(np.array([5, 5, 5, 9], dtype=np.uint8)) == pytest.approx(expected)
    assert unigram_entropy(np.arange(256, dtype=np.uint8)) == pytest.approx(math.log(256))


def test_token_windows_content_and_shifted_targets() -> None:
    tokens = np.arange(23, dtype=np.uint8)
    windows = TokenWindows(tokens, seq_len=5)
    assert len(windows) == (23 - 1) // 5 == 4
    x, y = windows.batch([3, 0])
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert x.shape == y.shape == (2, 5)
    assert x[0].tolist() == [15, 16, 17, 18, 19]
    assert y[0].tolist() == [16, 17, 18, 19, 20]
    assert x[1].tolist() == [0, 1, 2, 3, 4]
    x2, y2 = windows.batch(torch.tensor([3, 0]))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    # Exactly seq_len + 1 tokens per window at the boundary: 21 tokens give 4 windows.
    assert len(TokenWindows(np.arange(21, dtype=np.uint8), 5)) == 4
    assert len(TokenWindows(np.arange(20, dtype=np.uint8), 5)) == 3
    with pytest.raises(IndexError, match=r"0\.\.3"):
        windows.batch([4])
    with pytest.raises(ConfigError, match=r"3 tokens.*seq_len 5"):
        TokenWindows(np.arange(3, dtype=np.uint8), 5)
    # Read-only buffers (np.frombuffer of bytes) are accepted.
    assert len(TokenWindows(np.frombuffer(b"abcdefg", dtype=np.uint8), 3)) == 2


def test_sampler_is_deterministic_and_disjoint_within_an_epoch() -> None:
    a = GlobalBatchSampler(num_windows=50, global_batch=8, seed=3)
    b = GlobalBatchSampler(num_windows=50, global_batch=8, seed=3)
    epoch0 = [a.next_batch() for _ in range(a.batches_per_epoch)]
    assert all(torch.equal(x, b.next_batch()) for x in epoch0)
    assert all(x.dtype == torch.int64 and x.shape == (8,) for x in epoch0)
    seen = torch.cat(epoch0)
    assert len(set(seen.tolist())) == 48  # 6 batches, 2 windows of remainder dropped
    assert int(seen.min()) >= 0 and int(seen.max()) < 50
    other = GlobalBatchSampler(num_windows=50, global_batch=8, seed=4).next_batch()
    assert not torch.equal(other, epoch0[0])


def test_sampler_epoch_rollover_draws_a_new_permutation() -> None:
    s = GlobalBatchSampler(num_windows=10, global_batch=4, seed=0)
    first = [s.next_batch() for _ in range(2)]
    assert s.state_dict() == {"epoch": 0, "position": 8}
    third = s.next_batch()  # 2 left in epoch 0: dropped, epoch 1 begins
    assert s.state_dict() == {"epoch": 1, "position": 4}
    assert len(set(third.tolist())) == 4
    assert not torch.equal(third, first[0])


def test_sampler_state_dict_round_trip_continues_identically() -> None:
    ref = GlobalBatchSampler(num_windows=37, global_batch=5, seed=11)
    for _ in range(9):
        ref.next_batch()
    state = ref.state_dict()
    expected = [ref.next_batch() for _ in range(20)]
    restored = GlobalBatchSampler(num_windows=37, global_batch=5, seed=11)
    restored.load_state_dict(dict(state))
    assert all(torch.equal(e, restored.next_batch()) for e in expected)
    with pytest.raises(ConfigError, match=r"position"):
        restored.load_state_dict({"epoch": 0})


def test_sampler_needs_one_full_batch() -> None:
    with pytest.raises(ConfigError, match=r"\b7 windows.*\b8\b"):
        GlobalBatchSampler(num_windows=7, global_batch=8, seed=0)


def test_replica_shares_are_disjoint_and_concatenate() -> None:
    batch = GlobalBatchSampler(num_windows=100, global_batch=12, seed=1).next_batch()
    shares = [replica_share(batch, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([idx for idx, _ in shares]), batch)
    assert torch.equal(torch.cat([pos for _, pos in shares]), torch.arange(12))
    for idx, pos in shares:
        assert torch.equal(batch[pos], idx)
    assert len(set(torch.cat([idx for idx, _ in shares]).tolist())) == 12
    # Every rank of one replica gets identical data.
    assert torch.equal(replica_share(batch, 1, 3)[0], shares[1][0])
    with pytest.raises(ConfigError, match=r"12.*\b5\b"):
        replica_share(batch, 0, 5)
    with pytest.raises(ConfigError, match=r"dp_rank 3"):
        replica_share(batch, 3, 3)


def test_split_micro() -> None:
    t = torch.arange(12)
    parts = split_micro(t, 4)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert len(split_micro(t, 12)) == 1
    with pytest.raises(ConfigError, match=r"12.*\b5\b"):
        split_micro(t, 5)


def test_eval_indices_fixed_and_in_range() -> None:
    idx = eval_indices(num_windows=100, count=8)
    assert idx.dtype == torch.int64 and len(idx) == 8
    assert torch.equal(idx, eval_indices(100, 8))
    assert len(set(idx.tolist())) == 8
    assert int(idx.min()) >= 0 and int(idx.max()) < 100
    assert idx.tolist() == sorted(idx.tolist())
    assert torch.equal(eval_indices(num_windows=5, count=50), torch.arange(5))
    with pytest.raises(ConfigError, match=r"0 windows"):
        eval_indices(0, 4)
