"""`plait data prepare`: text in, token shards out, in parallel and in bounded memory.

Every check (paths, readability, `.jsonl` keys, parquet columns, the tokenizer, the output
folder) runs before a worker starts. Workers each encode one piece at a time; the main
process keeps at most `2 x workers` pieces in flight and writes their tokens in source
order, so memory is bounded by the piece size whatever the corpus size, and the stream is
the same for any number of workers. Everything is written into `OUT.partial` and renamed to
`OUT` only when the index is complete: a crash never leaves a folder that looks finished.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plait.data.shards import ShardWriter, write_index
from plait.data.sources import (
    PIECE_BYTES,
    SourcePiece,
    batched,
    check_sources,
    piece_bytes,
    plan_pieces,
    read_piece,
    source_files,
)
from plait.data.tokenizer import Encoder, TokenizerSpec, resolve_tokenizer
from plait.data.workers import Workers
from plait.errors import ConfigError
from plait.outdir import check_out_folder
from plait.signals import pause_at

SHARD_TOKENS = 1 << 27  # 256 MiB of uint16 per shard


@dataclass(frozen=True)
class PrepareJob:
    """One `data prepare` request, checked by `check()` before anything runs. Pieces are
    about `piece_bytes` of input, and one worker task is about that much too."""

    data: str | None
    out: Path
    tokenizer: str | None = None
    text_key: str = "text"
    workers: int = 1
    shard_tokens: int = SHARD_TOKENS
    piece_bytes: int = PIECE_BYTES
    overwrite: bool = False


def check(job: PrepareJob) -> tuple[TokenizerSpec, list[Path]]:
    """Everything that can fail on bad input, in the calling process: ConfigError names it."""
    if job.workers < 1:
        raise ConfigError(f"workers must be at least 1, got {job.workers}")
    if job.shard_tokens < 1:
        raise ConfigError(f"--shard-tokens must be at least 1, got {job.shard_tokens}")
    check_out_folder(job.out)
    if job.out.exists() and not job.overwrite:
        raise ConfigError(f"output folder {str(job.out)!r} exists; add --overwrite to replace it")
    spec = resolve_tokenizer(job.tokenizer)
    files = source_files(job.data)
    check_sources(files, job.text_key)
    return spec, files


@functools.cache
def _encoder(spec: TokenizerSpec) -> Encoder:
    """The tokenizer of this process, loaded on its first piece and kept for the rest."""
    return Encoder(spec)


def _worker_start() -> None:
    """A worker's first code (data/workers.py: it starts with the stop signals blocked; the
    parent ends it). Each worker is one process: the tokenizer's own thread pool would only
    compete with its siblings for the same cores."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    pause_at("prepare-worker", "worker")  # a worker starting: a test's signal


def _encode(
    batch: list[SourcePiece], text_key: str, spec: TokenizerSpec
) -> list[tuple[np.ndarray, int]]:
    """Each piece's tokens (its documents joined) and document count; the whole batch goes
    through the tokenizer in one call."""
    encoder = _encoder(spec)
    docs = [read_piece(piece, text_key) for piece in batch]
    flat = encoder.encode_docs([d for piece_docs in docs for d in piece_docs])
    out, at = [], 0
    for piece_docs in docs:
        out.append((encoder.join(flat[at : at + len(piece_docs)]), len(piece_docs)))
        at += len(piece_docs)
    return out


class _InProcess(Executor):
    """One worker: encode in this process (no pool to start, the same code path; the
    tokenizer's own threads may use every core)."""

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


def _ordered(
    pool: Executor,
    batches: Iterator[list[SourcePiece]],
    text_key: str,
    spec: TokenizerSpec,
    window: int,
) -> Iterator[tuple[SourcePiece, np.ndarray, int]]:
    """(piece, tokens, documents) in source order, with at most `window` batches submitted
    and not yet consumed: the bound on memory."""
    pending: deque[tuple[list[SourcePiece], Future]] = deque()

    def finished() -> Iterator[tuple[SourcePiece, np.ndarray, int]]:
        batch, future = pending.popleft()
        for piece, (tokens, docs) in zip(batch, future.result(), strict=True):
            yield piece, tokens, docs

    for batch in batches:
        pending.append((batch, pool.submit(_encode, batch, text_key, spec)))
        if len(pending) >= window:
            yield from finished()
    while pending:
        yield from finished()


def prepare(job: PrepareJob, advance: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Tokenize `job.data` into shards in `job.out`; returns the index. `advance(n)` is told
    of every n input bytes done (the progress bar)."""
    spec, files = check(job)
    partial = job.out.with_name(job.out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    writer = ShardWriter(partial, spec.dtype, job.shard_tokens)
    eos = np.array([spec.eos_id], dtype=spec.dtype)
    documents, first = 0, True
    try:
        with _pool(job.workers) as pool:
            batches = batched(plan_pieces(files, job.piece_bytes), job.piece_bytes)
            for piece, tokens, docs in _ordered(pool, batches, job.text_key, spec, 2 * job.workers):
                if piece.starts_doc and not first and docs:
                    writer.write(eos)
                writer.write(tokens)
                first = first and not docs
                documents += docs if piece.kind != "text" else int(piece.starts_doc)
                if advance:
                    advance(piece_bytes(piece))
                pause_at("prepare", "plait")  # workers busy, shards half written: a test's signal
    except BaseException:
        writer.close()
        shutil.rmtree(partial, ignore_errors=True)
        raise
    writer.close()
    if not writer.counts:
        shutil.rmtree(partial, ignore_errors=True)
        raise ConfigError(f"data path {job.data!r} holds no text to tokenize")
    sources = [{"path": str(f), "bytes": f.stat().st_size} for f in files]
    index = write_index(partial, spec, writer.counts, sources, documents)
    if job.out.exists():
        shutil.rmtree(job.out)
    partial.rename(job.out)
    return index


def _pool(workers: int) -> Executor:
    return _InProcess() if workers == 1 else Workers(workers, _worker_start)
