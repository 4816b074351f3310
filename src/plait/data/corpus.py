"""Corpus and byte tokenizer: which text a run trains on, as a stream of byte tokens.

Nothing is downloaded: the default corpus is the Python standard library's own source,
which every machine running plait already has. Tokens are raw UTF-8 bytes, so there is
no vocabulary file to ship and the tokenizer cannot disagree between machines.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from plait.errors import ConfigError

# Directory names never descended into: bytecode caches and third-party packages are
# not "the text this machine has", and site-packages differs between machines.
_SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
# A NUL byte in a file's head is the same heuristic git and grep use for "binary".
_BINARY_PROBE_BYTES = 4096


class ByteTokenizer:
    """Token ids are the UTF-8 bytes of the text: a fixed 256-symbol vocabulary."""

    vocab_size: int = 256

    def encode(self, text: str) -> np.ndarray:
        """Return the UTF-8 bytes of ``text`` as a uint8 array."""
        return np.frombuffer(bytearray(text.encode("utf-8")), dtype=np.uint8)

    def decode(self, ids: np.ndarray | torch.Tensor | Sequence[int]) -> str:
        """Turn ids back into text; byte sequences that are not valid UTF-8 (a model's
        samples, a window cut mid-character) become U+FFFD instead of raising."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        data = np.asarray(ids, dtype=np.int64)
        if data.size and (data.min() < 0 or data.max() > 255):
            raise ValueError(
                f"byte ids must lie in 0..255, got min {data.min()} and max {data.max()}"
            )
        return data.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def default_corpus_dir() -> Path:
    """The standard library's source directory: text that exists wherever Python does."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_default_corpus(path: Path) -> bool:
    try:
        return path.resolve() == default_corpus_dir().resolve()
    except OSError:
        return False


def _walk(root: Path, py_only: bool) -> Iterator[tuple[Path, int]]:
    """Yield (file, size) under ``root`` in sorted relative-path order, lazily.

    A depth-first walk that sorts each directory's entries by name yields paths ordered
    by their tuple of components, so the order is fixed without listing the whole tree
    first and a reader that stops early (``load_tokens``) only pays for what it reads.
    Empty files are skipped: they hold no text and would only add separators.
    """
    try:
        with os.scandir(root) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):  # not following: no symlink loops
                if entry.name not in _SKIP_DIRS:
                    yield from _walk(Path(entry.path), py_only)
            elif entry.is_file():
                if py_only and not entry.name.endswith(".py"):
                    continue
                size = entry.stat().st_size
                if size > 0:
                    yield Path(entry.path), size
        except OSError:
            continue  # vanished or unreadable while walking: not part of the corpus


def _looks_binary(head: bytes) -> bool:
    return b"\0" in head[:_BINARY_PROBE_BYTES]


def _file_is_binary(file: Path) -> bool:
    """True for a binary file, and for one that cannot be read (it is no text to train on)."""
    try:
        with open(file, "rb") as f:
            return _looks_binary(f.read(_BINARY_PROBE_BYTES))
    except OSError:
        return True


def _candidates(
    path: str | Path | None, binary_ok: tuple[str, ...] = ()
) -> tuple[Path, Iterator[tuple[Path, int]], bool]:
    """The resolved corpus path (None: the stdlib), files that may belong to it, and
    whether to probe them for binary (and skip those). A single file is the user's choice,
    but one that is not text (a NUL byte in its head) is refused rather than trained on
    as machine code, unless its suffix is in `binary_ok` (a format that holds text).
    """
    path = default_corpus_dir() if path is None else Path(path)
    if path.is_file():
        if path.suffix not in binary_ok and _file_is_binary(path):
            raise ConfigError(
                f"corpus file {str(path)!r} is not text (it has NUL bytes in its first "
                f"{_BINARY_PROBE_BYTES} bytes); give a text file or a folder of text files"
            )
        return path, iter([(path, path.stat().st_size)]), False
    if path.is_dir():
        return path, _walk(path, py_only=_is_default_corpus(path)), True
    if not path.exists():
        raise ConfigError(f"corpus path {str(path)!r} does not exist")
    raise ConfigError(f"corpus path {str(path)!r} is neither a regular file nor a directory")


def corpus_files(path: Path | None, binary_ok: tuple[str, ...] = ()) -> list[Path]:
    """The corpus files at ``path`` in the order ``load_tokens`` concatenates them.

    A file gives itself. A folder gives its non-empty regular files recursively, sorted
    by relative path, skipping hidden entries, ``__pycache__`` and ``site-packages``;
    the default (stdlib, ``path=None``) folder keeps only ``*.py``, a user folder skips
    binary files except those whose suffix is in ``binary_ok`` (``data prepare`` reads
    ``.parquet``).
    """
    _, files, probe = _candidates(path, binary_ok)
    return [
        file
        for file, _ in files
        if not (probe and file.suffix not in binary_ok and _file_is_binary(file))
    ]


def _check_max_bytes(max_bytes: int) -> None:
    if max_bytes < 1:
        raise ConfigError(f"max_bytes must be at least 1, got {max_bytes}")


def load_tokens(path: str | Path | None, max_bytes: int) -> np.ndarray:
    """Concatenate the corpus files' bytes, ``\\n`` between files, up to ``max_bytes``.

    ``path=None`` means the standard library. Reading stops as soon as ``max_bytes``
    are collected (the last file is cut), so a small budget reads a few files, not the
    whole tree. Returns a writable uint8 array.
    """
    _check_max_bytes(max_bytes)
    root, files, probe = _candidates(path)
    buf = bytearray()
    for file, _ in files:
        if len(buf) >= max_bytes:
            break
        try:
            with open(file, "rb") as f:
                head = f.read(_BINARY_PROBE_BYTES)
                if probe and _looks_binary(head):
                    continue
                sep = b"\n" if buf else b""
                remaining = max_bytes - len(buf) - len(sep)
                if remaining <= 0:  # only the separator would fit: end on a whole file
                    break
                data = head + f.read(max(remaining - len(head), 0))
        except OSError:
            continue
        if not data:
            continue
        buf += sep
        buf += data[:remaining]
    if not buf:
        raise ConfigError(f"corpus path {str(root)!r} holds no readable text files")
    return np.frombuffer(buf, dtype=np.uint8)


def corpus_bytes_available(path: str | Path | None, max_bytes: int) -> int:
    """How many bytes ``load_tokens(path, max_bytes)`` returns, from sizes and file heads.

    Cheap enough to validate a config before workers start: it stats files, reads the head
    of each to skip binaries as ``load_tokens`` does, and stops at ``max_bytes``.
    """
    _check_max_bytes(max_bytes)
    _, files, probe = _candidates(path)
    total = 0
    for file, size in files:
        if probe and _file_is_binary(file):
            continue
        total += size + (1 if total else 0)
        if total >= max_bytes:
            return max_bytes
    return total


def unigram_entropy(tokens: np.ndarray | torch.Tensor) -> float:
    """Entropy in nats of the byte frequencies in ``tokens``.

    It is the cross-entropy of the best model that ignores context, so a training loss
    that does not go below it has learned nothing but symbol counts.
    """
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    flat = np.asarray(tokens).reshape(-1)
    if flat.size == 0:
        raise ConfigError("unigram_entropy needs at least one token, got 0")
    counts = np.bincount(flat.astype(np.int64))
    p = counts[counts > 0] / flat.size
    return float(-(p * np.log(p)).sum())
