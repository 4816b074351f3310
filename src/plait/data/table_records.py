"""Instruction rows from Hugging Face `datasets` files: parquet, and Arrow IPC (`.arrow`, the
files `Dataset.save_to_disk` writes, in Arrow's stream format, or the random-access file
format), read through pyarrow.

A table's row is the same dictionary a JSON line is, so `records.read_records` applies the
same column mapping (`--columns`) and the same checks to it; a chat column of
`list<struct<role, content>>` arrives as the list of messages. pyarrow stays optional (the
`parquet` extra): without it such a file is refused in one line naming the extra. A folder that
`save_to_disk` wrote (its `state.json` lists the data files) gives those files, in order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from plait.data.corpus import corpus_files
from plait.errors import ConfigError

TABLES = (".parquet", ".arrow")
"""The suffixes read as tables rather than as JSON or JSONL."""


def is_table(file: Path) -> bool:
    return file.suffix in TABLES


def instruction_files(path: str) -> list[Path]:
    """The files of `--data` for instruction formats: a file, a `save_to_disk` folder's data
    files (from its state.json), or a folder's files (tables kept, other binaries skipped)."""
    folder = Path(path)
    state = folder / "state.json"
    if folder.is_dir() and state.is_file() and (folder / "dataset_info.json").is_file():
        try:
            names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(
                f"{str(state)!r} is not a `datasets` save_to_disk state (no _data_files list)"
            ) from None
        return [folder / name for name in names]
    files = corpus_files(folder, binary_ok=TABLES)
    if not files:
        raise ConfigError(f"data path {path!r} holds no readable files")
    return files


def _pyarrow() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ConfigError(
            "reading .parquet and .arrow files needs pyarrow: pip install 'plait[parquet]'"
        ) from None
    return pa


def _batches(file: Path) -> Iterator[Any]:
    """The file's record batches: parquet by row group, Arrow IPC in either format."""
    pa = _pyarrow()
    try:
        if file.suffix == ".parquet":
            yield from pa.parquet.ParquetFile(file).iter_batches()
            return
        with pa.memory_map(str(file)) as source:
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # not the file format: `save_to_disk`'s stream format
                source.seek(0)
                batches = iter(pa.ipc.open_stream(source))
            yield from batches
    except (pa.ArrowException, OSError) as e:
        kind = "parquet" if file.suffix == ".parquet" else "Arrow IPC"
        raise ConfigError(f"data file {str(file)!r} is not a readable {kind} file: {e}") from None


def table_rows(file: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`row N`, the row as a dictionary of its columns) for every row of `file`, 1-based."""
    number = 0
    for batch in _batches(file):
        for row in batch.to_pylist():
            number += 1
            yield f"row {number}", row
