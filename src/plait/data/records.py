"""Instruction records from files: Alpaca rows and chat conversations, checked as they are read.

A file is a JSON array (its first non-blank character is `[`, as Stanford's
alpaca_data.json; never for a `.jsonl` file) or JSONL (one object a line, blank lines
skipped). Every problem is one ConfigError naming the file and the line where the row
starts: invalid JSON, a row that is not an object, a missing field or one of the wrong
type, a chat row without an assistant turn, an empty file.
`--columns instruction=prompt,output=completion` reads a field under another name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.data.table_records import is_table, table_rows
from plait.errors import ConfigError

FIELDS = {"alpaca": ("instruction", "input", "output"), "chat": ("messages",)}
OPTIONAL = frozenset({"input"})


@dataclass(frozen=True)
class Record:
    """One example as read: its place (file:line) and its fields under plait's names."""

    where: str
    fields: dict[str, Any]


def parse_columns(spec: str | None, fmt: str) -> dict[str, str]:
    """`instruction=prompt,output=completion` -> {plait's name: the file's name}."""
    names = {name: name for name in FIELDS[fmt]}
    if not spec:
        return names
    for part in spec.split(","):
        ours, eq, theirs = part.partition("=")
        ours, theirs = ours.strip(), theirs.strip()
        if not eq or not theirs or ours not in names:
            raise ConfigError(
                f"--columns {spec!r}: {part!r} is not FIELD=NAME with FIELD one of "
                f"{', '.join(FIELDS[fmt])} (for --format {fmt})"
            )
        names[ours] = theirs
    return names


def _json_rows(file: Path, text: str) -> Iterator[tuple[int, Any]]:
    """(line, value) of each element of a JSON array, or of each line of JSONL (a `.jsonl`
    file always, whatever its first row is)."""
    decoder = json.JSONDecoder()
    stripped = text.lstrip()
    if stripped.startswith("[") and file.suffix != ".jsonl":
        at = len(text) - len(stripped) + 1
        line = text.count("\n", 0, at) + 1
        while True:
            start = at
            while at < len(text) and text[at] in " \t\r\n,":
                at += 1
            line += text.count("\n", start, at)
            if at < len(text) and text[at] == "]":
                return
            try:
                value, end = decoder.raw_decode(text, at)
            except ValueError as e:
                bad = getattr(e, "lineno", line)
                raise ConfigError(f"{file}:{bad} is not valid JSON ({_reason(e)})") from None
            yield line, value
            line += text.count("\n", at, end)
            at = end
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            yield number, json.loads(raw)
        except ValueError as e:
            raise ConfigError(f"{file}:{number} is not valid JSON ({_reason(e)})") from None


def _reason(e: ValueError) -> str:
    return getattr(e, "msg", str(e))


def _field(where: str, row: dict, ours: str, theirs: str, fmt: str) -> Any:
    if theirs not in row:
        if ours in OPTIONAL:
            return None
        hint = f" (read it from another field with --columns {ours}=NAME)"
        raise ConfigError(
            f"{where} has no field {theirs!r}; fields: {', '.join(map(repr, row)) or 'none'}" + hint
        )
    value = row[theirs]
    if fmt == "alpaca" and not (isinstance(value, str) or (ours in OPTIONAL and value is None)):
        raise ConfigError(
            f"{where} field {theirs!r} must be a string, got {type(value).__name__} {value!r:.40}"
        )
    return value


def _check_messages(where: str, messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where} field messages must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):  # fmt: skip
            raise ConfigError(
                f"{where} message {i} must be an object with string role and content, got {m!r:.60}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(m["role"] for m in messages)
        raise ConfigError(f"{where} has no assistant turn (roles: {roles}); nothing to learn")


def read_records(file: Path, fmt: str, columns: dict[str, str]) -> list[Record]:
    """Every example of `file` in order, each checked; ConfigError on the first bad one.
    A `.parquet` or `.arrow` file's rows come through pyarrow (table_records.py)."""
    if is_table(file):
        rows: Iterator[tuple[Any, Any]] = table_rows(file)
    else:
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"data file {str(file)!r} cannot be read: {e}") from None
        if not text.strip():
            raise ConfigError(f"data file {str(file)!r} is empty; --format {fmt} needs examples")
        rows = _json_rows(file, text)
    out = []
    for line, row in rows:
        where = f"{file}:{line}"
        if not isinstance(row, dict):
            raise ConfigError(f"{where} is a {type(row).__name__}, not a JSON object")
        fields = {ours: _field(where, row, ours, theirs, fmt) for ours, theirs in columns.items()}
        if fmt == "chat":
            _check_messages(where, fields["messages"])
        out.append(Record(where, fields))
    if not out:
        raise ConfigError(f"data file {str(file)!r} holds no examples (an empty array)")
    return out
