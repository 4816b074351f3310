"""Instruction files as Hugging Face `datasets` writes them: parquet, Arrow IPC (stream and
file format) and a `save_to_disk` folder, read through pyarrow with JSON's column mapping and
checks, prepared into the same tokens as the JSONL of the same rows; pyarrow missing or a
damaged file refused in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from instruct_data import CHATML_TEMPLATE, CHATS, ROWS, tokenizer_folder, write_jsonl
from plait.cli import main
from plait.data.examples import ExampleStore
from plait.data.records import parse_columns, read_records
from plait.errors import ConfigError


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return tokenizer_folder(tmp_path_factory.mktemp("tables") / "tok", CHATML_TEMPLATE)


def _stream(path: Path, table: pa.Table) -> Path:
    """An Arrow IPC stream, as `Dataset.save_to_disk` writes its data files."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)  # several record batches
    return path


def _ipc_file(path: Path, table: pa.Table) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    return path


def _save_to_disk(folder: Path, table: pa.Table) -> Path:
    """A folder laid out as `datasets`' save_to_disk: data files named by state.json."""
    folder.mkdir()
    half = table.num_rows // 2
    _stream(folder / "data-00000-of-00002.arrow", table.slice(0, half))
    _stream(folder / "data-00001-of-00002.arrow", table.slice(half))
    files = [{"filename": f"data-0000{i}-of-00002.arrow"} for i in range(2)]
    (folder / "state.json").write_text(json.dumps({"_data_files": files, "_split": "train"}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return folder


def _fields(file: Path, fmt: str, columns: str | None = None) -> list[dict]:
    return [r.fields for r in read_records(file, fmt, parse_columns(columns, fmt))]


def test_every_table_kind_reads_the_rows_json_reads(tmp_path) -> None:
    table = pa.Table.from_pylist([{**r, "input": r.get("input")} for r in ROWS])
    jsonl = _fields(write_jsonl(tmp_path / "a.jsonl", ROWS), "alpaca")
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    assert _fields(tmp_path / "a.parquet", "alpaca") == jsonl
    assert _fields(_stream(tmp_path / "s.arrow", table), "alpaca") == jsonl
    assert _fields(_ipc_file(tmp_path / "f.arrow", table), "alpaca") == jsonl
    chats = pa.Table.from_pylist([{"messages": m} for m in CHATS])  # list<struct<...>>
    pq.write_table(chats, tmp_path / "c.parquet")
    assert _fields(tmp_path / "c.parquet", "chat") == [{"messages": m} for m in CHATS]
    renamed = table.rename_columns(["prompt", "input", "completion"])
    pq.write_table(renamed, tmp_path / "r.parquet")
    spec = "instruction=prompt,output=completion"
    assert _fields(tmp_path / "r.parquet", "alpaca", spec) == jsonl
    with pytest.raises(ConfigError, match=r"r\.parquet:row 1 has no field 'instruction'"):
        _fields(tmp_path / "r.parquet", "alpaca")


def _prepare(data: Path, out: Path, tok: Path, fmt: str = "alpaca") -> ExampleStore:
    argv = ["data", "prepare", "--format", fmt, "--data", str(data), "--tokenizer", str(tok),
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    return ExampleStore(out)


def _tokens(store: ExampleStore) -> list[tuple[list[int], list[int]]]:
    return [tuple(a.tolist() for a in store.example(i, int(store.lengths[i])))
            for i in range(len(store))]  # fmt: skip


def test_a_save_to_disk_folder_prepares_as_its_jsonl(tmp_path, tok, capsys) -> None:
    rows = [{"messages": m} for m in CHATS] * 2
    want = _tokens(_prepare(write_jsonl(tmp_path / "c.jsonl", rows), tmp_path / "j", tok, "chat"))
    folder = _save_to_disk(tmp_path / "ds", pa.Table.from_pylist(rows))
    got = _tokens(_prepare(folder, tmp_path / "d", tok, "chat"))
    assert got == want and len(got) == 6
    assert np.sum([sum(mask) for _, mask in got]) > 0


def test_missing_pyarrow_and_damaged_tables_are_one_line(tmp_path, tok, capsys) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    out = ["--tokenizer", str(tok), "--out", str(tmp_path / "o")]
    assert main(["data", "prepare", "--format", "alpaca", "--data", str(bad), *out]) == 2
    err = capsys.readouterr().err.strip()
    assert f"data file '{bad}' is not a readable parquet file" in err
    assert "UTF-8" not in err and len(err.splitlines()) == 1
    broken = tmp_path / "bad.arrow"
    broken.write_bytes(b"\x00" * 64)
    assert main(["data", "prepare", "--format", "alpaca", "--data", str(broken), *out]) == 2
    assert f"data file '{broken}' is not a readable Arrow IPC file" in capsys.readouterr().err
    good = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), good)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
        assert main(["data", "prepare", "--format", "alpaca", "--data", str(good), *out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "reading .parquet and .arrow files needs pyarrow: pip install 'plait[parquet]'"
    )
    assert len(err.splitlines()) == 1
