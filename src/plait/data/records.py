"""Instruction records from files: Alpaca rows and chat conversations, checked as they are read.

A file is a JSON array (its first non-blank character is `[`, as Stanford's
alpaca_data.json; never for a `.jsonl` file), read by `json.loads` as Stanford's `jload`
reads it, or JSONL (one object a line, blank lines skipped), each line read by `json.loads`.
Nothing is read leniently: a trailing, missing or extra comma, text after the array's `]` or
a second array joined on (`cat a.json b.json`) is refused, never skipped. Every problem is
one ConfigError naming the file, the line (and for invalid JSON the column): invalid JSON, a
row that is not an object, a missing field or one of the wrong type, a chat message whose
role is not one of `ROLES`, a chat row without an assistant turn, an empty file.
`--columns instruction=prompt,output=completion` reads a field under another name.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.data.table_records import is_table, table_rows
from plait.errors import ConfigError

FIELDS = {"alpaca": ("instruction", "input", "output"), "chat": ("messages",)}
OPTIONAL = frozenset({"input"})
ROLES = ("system", "user", "assistant", "tool", "ipython")
"""The roles of chat messages that templates render (OpenAI's four, and Llama 3.1's ipython):
another is a typo or a format plait does not know, refused rather than left to a template
that may drop it without a word."""


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
    stripped = text.lstrip()
    if stripped.startswith("[") and file.suffix != ".jsonl":
        yield from _array_rows(file, text, len(text) - len(stripped))
        return
    if stripped.startswith("{") and file.suffix != ".jsonl":
        _refuse_one_object(file, text)
    # "\n" alone ends a line: str.splitlines would also cut at U+2028 and other characters
    # that JSON allows unescaped inside a string, splitting one row in two.
    for number, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        try:
            yield number, json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}:{number}:{e.colno} is not valid JSON ({e.msg})") from None


def _array_rows(file: Path, text: str, at: int) -> Iterator[tuple[int, Any]]:
    """The elements of the JSON array that starts at `at`, each with the line it starts on.
    The whole text goes through `json.loads` first, as Stanford's `jload` reads it: a
    trailing, missing or extra comma, or anything after the closing `]` (a second array
    joined on with `cat`) is refused with its line and column; only then are the elements'
    lines found, on text known to be one valid array."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(_array_error(file, text, e)) from None
    decoder = json.JSONDecoder()
    line, at = text.count("\n", 0, at) + 1, at + 1
    while True:
        start = at
        while text[at] in " \t\r\n,":
            at += 1
        line += text.count("\n", start, at)
        if text[at] == "]":
            return
        value, end = decoder.raw_decode(text, at)
        yield line, value
        line += text.count("\n", at, end)
        at = end


def _array_error(file: Path, text: str, e: json.JSONDecodeError) -> str:
    """The line naming where and why `json.loads` refused a JSON-array file."""
    where = f"{file}:{e.lineno}:{e.colno}"
    before = text[: e.pos].rstrip()
    if e.msg == "Extra data":
        after = text[e.pos : e.pos + 20]
        what = "another JSON document" if after[0] in "[{" else f"text ({after!r})"
        return (
            f"{where}: {what} after the array's closing ']' on line "
            f"{text.count(chr(10), 0, len(before)) + 1}; a file holds one JSON array (files "
            "joined with cat? give them as a folder or one array)"
        )
    if e.msg == "Expecting value" and before.endswith(","):
        comma = "a comma before ']' (a trailing comma)" if text[e.pos] == "]" else "two commas"
        return f"{where} is not valid JSON: {comma}, which json.load refuses"
    return f"{where} is not valid JSON ({e.msg})"


def _refuse_one_object(file: Path, text: str) -> None:
    """A non-`.jsonl` file that holds one JSON object spread over lines is neither an array
    of rows nor JSONL: say so, rather than report its first line as broken JSON."""
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return  # JSONL (or broken): read line by line, which names the line
    if isinstance(whole, dict) and text.strip().count("\n"):
        raise ConfigError(
            f"data file {str(file)!r} holds one JSON object over several lines, not rows: "
            "give a JSON array of rows, or JSONL (one object a line)"
        )


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
        if m["role"] not in ROLES:
            raise ConfigError(
                f"{where} message {i} has role {m['role']!r}, which is none of {', '.join(ROLES)}"
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


def unrendered(records: list[Record], render: Callable[[list[dict[str, Any]]], str]) -> Counter:
    """Messages (by role) whose content a chat template leaves out of the text it renders
    (`render`: the whole conversation), which training never sees: counted for the summary,
    so a template that drops, say, tool turns does not drop them unsaid. A template may trim
    a content, so its stripped text is looked for; an empty content is never counted."""
    dropped: Counter = Counter()
    for record in records:
        messages = record.fields["messages"]
        text = render(messages)
        for m in messages:
            content = m["content"].strip()
            if content and content not in text:
                dropped[m["role"]] += 1
    return dropped
