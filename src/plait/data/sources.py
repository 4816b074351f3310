"""Documents from text files, folders, `.jsonl` and `.parquet`, cut into bounded pieces.

`data prepare` and `tokenizer train` never hold a corpus in memory: the sources are cut into
pieces of about `PIECE_BYTES` (text and `.jsonl` at line ends, `.parquet` by row group), a
worker reads and encodes one piece at a time, and the pieces are written in source order.
The cut depends only on the files, never on the number of workers, so the token stream is
the same whatever the parallelism.

A text file is one document; a `.jsonl` line and a `.parquet` row are one document each.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from plait.data.corpus import corpus_files
from plait.errors import ConfigError

PIECE_BYTES = 8 << 20
_RECORDS = (".jsonl", ".parquet")


@dataclass(frozen=True)
class SourcePiece:
    """A part of one source file: a byte range (text, `.jsonl`) or a row group (`.parquet`).

    `starts_doc`: the piece begins a new document, so an end-of-document token goes before
    it (unless it is the very first piece of the stream)."""

    file: str
    kind: str  # "text", "jsonl" or "parquet"
    start: int
    end: int
    starts_doc: bool


def _kind(file: Path) -> str:
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(file.suffix, "text")


def source_files(path: str | None) -> list[Path]:
    """The files `path` names (None: the standard library), in a fixed order; ConfigError
    when there is nothing to read."""
    files = corpus_files(None if path is None else Path(path), binary_ok=(".parquet",))
    if not files:
        raise ConfigError(f"data path {path!r} holds no readable text files")
    return files


def _pyarrow():  # -> the pyarrow.parquet module
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("reading .parquet needs pyarrow: pip install 'plait[parquet]'") from None
    return pq


def check_sources(files: list[Path], text_key: str) -> None:
    """Every file is readable, every `.jsonl` line is a JSON object with a string under
    `text_key`, every `.parquet` file has that column: found here, before any worker."""
    for file in files:
        try:
            with file.open("rb") as fh:
                fh.read(1)
        except OSError as e:
            raise ConfigError(f"data file {str(file)!r} cannot be read: {e.strerror}") from None
        if file.suffix == ".jsonl":
            _check_jsonl(file, text_key)
        elif file.suffix == ".parquet":
            _check_parquet(file, text_key)


def _check_jsonl(file: Path, key: str) -> None:
    with file.open("rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"{file}:{number}:{e.colno} is not valid JSON ({e.msg})"
                ) from None
            except UnicodeDecodeError as e:
                raise ConfigError(f"{file}:{number} is not UTF-8 ({e.reason})") from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise ConfigError(
                    f"{file}:{number} has no string field {key!r} (set the field with --text-key)"
                )


def _check_parquet(file: Path, key: str) -> None:
    pq = _pyarrow()
    try:
        names = pq.read_schema(file).names
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise ConfigError(f"data file {str(file)!r} is not a readable parquet file: {e}") from None
    if key not in names:
        raise ConfigError(
            f"parquet file {str(file)!r} has no column {key!r} (columns: {', '.join(names)}; "
            "set the column with --text-key)"
        )


def plan_pieces(files: list[Path], piece_bytes: int = PIECE_BYTES) -> Iterator[SourcePiece]:
    """The pieces of every file, in order; lazily, so planning holds nothing in memory."""
    for file in files:
        kind = _kind(file)
        if kind == "parquet":
            groups = _pyarrow().ParquetFile(file).num_row_groups
            for g in range(groups):
                yield SourcePiece(str(file), kind, g, g + 1, True)
            continue
        size, start = file.stat().st_size, 0
        with file.open("rb") as fh:
            while start < size:
                end = _line_end(fh, start + piece_bytes, size)
                yield SourcePiece(str(file), kind, start, end, kind == "jsonl" or start == 0)
                start = end


def batched(pieces: Iterator[SourcePiece], batch_bytes: int) -> Iterator[list[SourcePiece]]:
    """Consecutive pieces grouped to about `batch_bytes` of input: one task for a worker,
    so a folder of small files is not one round trip per file."""
    batch: list[SourcePiece] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += piece_bytes(piece)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _line_end(fh, at: int, size: int) -> int:
    """The offset just past the first newline at or after `at` (or the end of the file)."""
    if at >= size:
        return size
    fh.seek(at)
    while True:
        block = fh.read(1 << 16)
        if not block:
            return size
        nl = block.find(b"\n")
        if nl >= 0:
            return at + nl + 1
        at += len(block)


def read_piece(piece: SourcePiece, text_key: str) -> list[bytes | str]:
    """The documents of one piece: raw bytes of a text file's range (the byte tokenizer
    keeps them exactly), or the `text_key` strings of its records."""
    if piece.kind == "parquet":
        table = _pyarrow().ParquetFile(piece.file).read_row_group(piece.start, columns=[text_key])
        return [t for t in table.column(text_key).to_pylist() if t is not None]
    with open(piece.file, "rb") as fh:
        fh.seek(piece.start)
        data = fh.read(piece.end - piece.start)
    if piece.kind == "text":
        return [data]
    return [json.loads(line)[text_key] for line in data.splitlines() if line.strip()]


def piece_bytes(piece: SourcePiece) -> int:
    """The piece's share of the input file's bytes, for progress (a row group: an even share)."""
    if piece.kind != "parquet":
        return piece.end - piece.start
    groups = _pyarrow().ParquetFile(piece.file).num_row_groups
    return Path(piece.file).stat().st_size // groups


def iter_texts(files: list[Path], text_key: str) -> Iterator[str]:
    """Every document as text, in order (tokenizer training reads them once, streaming).
    A long text file arrives in pieces; BPE training counts words, so that cut is harmless."""
    for piece in plan_pieces(files):
        for doc in read_piece(piece, text_key):
            yield doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc


def total_bytes(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files)
