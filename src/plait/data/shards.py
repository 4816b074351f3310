"""Token shards on disk: raw `.bin` arrays of one dtype plus `index.json`, memory-mapped.

A prepared folder holds `shard-00000.bin`, `shard-00001.bin`, ... (little-endian uint16 or
uint32, no header) and `index.json`: the dtype, the tokens per shard, the tokenizer (path,
vocabulary, end-of-document id, SHA-256) and the source files. The shards are one token
stream cut at fixed token counts, so the stream (and everything the sampler derives from it)
does not depend on how many shards or workers made it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from plait.data.tokenizer import TokenizerSpec
from plait.errors import ConfigError

INDEX = "index.json"
FORMAT = 1


def is_shard_dir(path: str | Path | None) -> bool:
    return path is not None and (Path(path) / INDEX).is_file()


class ShardWriter:
    """Appends token arrays to consecutive shard files of `shard_tokens` tokens each."""

    def __init__(
        self, folder: Path, dtype: np.dtype, shard_tokens: int, prefix: str = "shard"
    ) -> None:
        if shard_tokens < 1:
            raise ConfigError(f"shard_tokens must be at least 1, got {shard_tokens}")
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.prefix = prefix
        self.counts: list[int] = []
        self._fh = None

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype.newbyteorder("<"), copy=False)
        while len(tokens):
            if self._fh is None or self.counts[-1] == self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.counts[-1]
            part, tokens = tokens[:room], tokens[room:]
            self._fh.write(part.tobytes())
            self.counts[-1] += len(part)

    def _open_next(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._fh = (self.folder / shard_name(len(self.counts), self.prefix)).open("wb")
        self.counts.append(0)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def shard_name(i: int, prefix: str = "shard") -> str:
    return f"{prefix}-{i:05d}.bin"


def write_index(
    folder: Path, spec: TokenizerSpec, counts: list[int], sources: list[dict[str, Any]],
    documents: int, extra: dict[str, Any] | None = None, masked: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Write `index.json`; `extra` adds keys (an examples folder's kind and examples), and
    `masked` names each shard's target-mask file beside it (`mask-*.bin`, the same cut)."""
    shards = [{"file": shard_name(i), "tokens": n} for i, n in enumerate(counts)]
    for i, shard in enumerate(shards if masked else []):
        shard["mask"] = shard_name(i, "mask")
    index = {
        "format": FORMAT,
        "dtype": spec.dtype.name,
        "tokens": sum(counts),
        "documents": documents,
        "shards": shards,
        "tokenizer": {
            "path": spec.path,
            "vocab_size": spec.vocab_size,
            "eos_id": spec.eos_id,
            "sha256": spec.identity,
        },
        "sources": sources,
        **(extra or {}),
    }
    (folder / INDEX).write_text(json.dumps(index, indent=2))
    return index


def read_index(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / INDEX
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"shard index {str(path)!r} cannot be read: {e}") from None
    if index.get("format") != FORMAT:
        raise ConfigError(
            f"shard index {str(path)!r} has format {index.get('format')!r}; this plait reads "
            f"format {FORMAT} (prepare the data again)"
        )
    return index


class ShardStream:
    """The shards as one read-only token stream, memory-mapped (nothing read up front).

    Slicing gives another stream over the same maps (the train/validation split); `take`
    reads only the windows asked for, across shard boundaries when a window spans two.
    """

    def __init__(
        self, folder: str | Path, start: int = 0, stop: int | None = None,
        key: str = "file", dtype: str | None = None,
    ) -> None:  # fmt: skip
        """`key`/`dtype`: another array cut like the tokens (an examples folder's target
        masks: key "mask", dtype uint8)."""
        self.folder = Path(folder)
        index = read_index(folder)
        dtype = np.dtype(dtype or index["dtype"]).newbyteorder("<")
        self._maps, self._ends = [], []
        end = 0
        for shard in index["shards"]:
            file = self.folder / shard[key]
            expected = shard["tokens"] * dtype.itemsize
            if not file.is_file() or file.stat().st_size != expected:
                raise ConfigError(
                    f"shard {str(file)!r} is missing or not {expected} bytes as its index says"
                )
            self._maps.append(np.memmap(file, dtype=dtype, mode="r"))
            end += shard["tokens"]
            self._ends.append(end)
        self._starts = [e - len(m) for e, m in zip(self._ends, self._maps, strict=True)]
        total = end
        self.start, self.stop = start, total if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> ShardStream:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a ShardStream is sliced with [a:b] only")
        a, b, _ = key.indices(len(self))
        view = object.__new__(ShardStream)
        view.__dict__.update(self.__dict__)
        view.start, view.stop = self.start + a, self.start + max(a, b)
        return view

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of this stream as int64 (a copy; touches only those pages)."""
        a, b = self.start + a, self.start + b
        parts = []
        for s, e, m in zip(self._starts, self._ends, self._maps, strict=True):
            if e > a and s < b:
                parts.append(m[max(a, s) - s : min(b, e) - s])
        return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)

    def take(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows `[start, start + length)` for each start: (len(starts), length) int64."""
        return np.stack([self.read(int(s), int(s) + length) for s in starts])


def shard_tokenizer(folder: str | Path, given: TokenizerSpec | None) -> TokenizerSpec:
    """The tokenizer the shards at `folder` were made with; ConfigError if `given` (the run's
    `--tokenizer`) is a different one: its tokens would mean other strings."""
    made = read_index(folder)["tokenizer"]
    spec = TokenizerSpec(made["path"], made["vocab_size"], made["eos_id"], made["sha256"])
    if given is not None and given.identity != spec.identity:
        raise ConfigError(
            f"shards {str(folder)!r} were made with tokenizer {spec.name} (sha256 "
            f"{spec.identity}), not with {given.name} (sha256 {given.identity}); prepare "
            "them again with this tokenizer, or leave --tokenizer out"
        )
    return spec
