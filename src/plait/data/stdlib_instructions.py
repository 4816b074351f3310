"""An instruction set built offline from Python sources: every documented public function
becomes an Alpaca record (`instruction`, `input`, `output`).

Nothing is downloaded: the default source is this Python's standard library, the same text
the default training corpus reads (`corpus.default_corpus_dir`), so every machine can build
the same set and fine-tune on it. A record asks for the function its docstring describes:

- `instruction`: a fixed phrasing naming the module (and the class, for a method), then the
  cleaned docstring. The docstring says what to do; the module and class say where, which
  is most of what a reader would need to guess the helpers the body calls.
- `input`: the signature as written (`def name(args) -> ret:`, over several lines if it is;
  decorators are left to the output). With it the model has a fair chance: argument names
  and defaults are not guessable from prose.
- `output`: the function's source, decorators and `def` line included, dedented, without
  the docstring. The docstring is already the instruction; repeated in the response it would
  make a share of the target tokens a copy of the prompt, which teaches copying and makes
  the response loss fall for the wrong reason.

Order is deterministic (files sorted by relative path, definitions in source order), and so
are the filters (lengths of Alpaca-like responses, a few dozen to a few hundred tokens),
the dedup (first occurrence of an output or of an instruction+input wins) and the cap
(evenly spaced picks, so a capped set still spans every module, not only the first ones).
"""

from __future__ import annotations

import ast
import json
import os
import re
import tokenize
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from plait.data.corpus import default_corpus_dir
from plait.errors import ConfigError

# Folders never read: caches, third-party packages, and the stdlib's own test suites (test
# functions are rarely documented, and a few test files are not valid Python on purpose).
SKIP_DIRS = frozenset(
    {"__pycache__", "site-packages", "dist-packages", "test", "tests", "idle_test"}
)
_NEWLINE = re.compile(r"\r\n|\r|\n")  # the line ends ast counts (str.splitlines has more)


@dataclass(frozen=True)
class Limits:
    """What a record must satisfy to be kept. Characters, not tokens: the set is built before
    any tokenizer is chosen; at ~3.5 characters per BPE token of code, the output bounds are
    about 25 to 430 tokens, Alpaca's range."""

    min_doc_chars: int = 20  # "Return x." says too little to write a function from
    max_doc_chars: int = 1000
    min_output_lines: int = 3  # the `def` line and at least two lines of body
    max_output_lines: int = 50
    min_output_chars: int = 80
    max_output_chars: int = 1500
    max_record_chars: int = 2400  # instruction + input + output


@dataclass
class Counts:
    """What building read and kept, for the command's summary line."""

    files: int = 0
    unreadable: int = 0  # not decodable or not valid Python
    documented: int = 0  # documented public functions and methods found
    dropped: Counter = field(default_factory=Counter)  # reason -> records
    duplicates: int = 0
    capped: int = 0
    kept: int = 0


def python_files(root: Path) -> Iterator[Path]:
    """The `.py` files under `root`, sorted by relative path (a depth-first walk over sorted
    entries), skipping hidden entries, SKIP_DIRS, private modules and symlinked folders."""
    try:
        with os.scandir(root) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith((".", "_")) and entry.name != "__init__.py":
            continue
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in SKIP_DIRS:
                yield from python_files(Path(entry.path))
        elif entry.name.endswith(".py") and entry.is_file():
            yield Path(entry.path)


def _module_name(file: Path, root: Path) -> str:
    parts = list(file.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or root.name


def _definitions(
    body: list[ast.stmt], owner: str | None = None
) -> Iterator[tuple[str | None, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(class name or None, function) for the public functions of a module body and the
    public methods of its public classes (nested classes too), in source order."""
    for node in body:
        # Only definitions have a str name: Python 3.12's `type X = ...` (ast.TypeAlias) has a
        # `name` that is an ast.Name node.
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.name.startswith("_"):
            continue
        if isinstance(node, ast.ClassDef):
            yield from _definitions(node.body, f"{owner}.{node.name}" if owner else node.name)
        else:
            yield owner, node


def function_source(
    lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef
) -> tuple[str, str] | None:
    """The signature (the `def` lines as written, up to the docstring) and the function's
    lines (decorators first), dedented by the `def`'s indentation, with the docstring's lines
    and the blank lines after them removed; None when that cannot be done cleanly: the
    docstring shares a line with code, nothing but the docstring is left, or a line (inside
    a string) is indented less than the `def`. The signature is the source's own text, not
    `ast.unparse`'s (`x: int=1`), so the output begins with exactly what the input shows."""
    doc, rest = node.body[0], node.body[1:]
    if not rest or rest[0].lineno == doc.end_lineno or doc.lineno == node.lineno:
        return None
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    indent = lines[node.lineno - 1][: node.col_offset]
    if indent.strip():
        return None  # `def` after other code on its line (`if x: def f(): ...`)
    kept = lines[first - 1 : doc.lineno - 1]
    after = lines[doc.end_lineno : node.end_lineno]
    while after and not after[0].strip():
        after.pop(0)
    out = []
    for line in kept + after:
        if line.strip() and not line.startswith(indent):
            return None
        out.append(line[len(indent) :] if line.strip() else "")
    header = out[node.lineno - first : doc.lineno - first]
    while header[-1].strip().startswith("#") or not header[-1].strip():
        header.pop()  # comments or blank lines between the `def` and its docstring
    return "\n".join(header), "\n".join(out)


def instruction(module: str, owner: str | None, doc: str) -> str:
    """The fixed phrasing: what to write, where it lives, then the docstring."""
    where = f"a method of class `{owner}` in module `{module}`" if owner else f"module `{module}`"
    what = "method" if owner else "function"
    return f"Write the Python {what} ({where}) that this docstring describes:\n\n{doc}"


def _too_long_or_short(record: dict[str, str], doc: str, limits: Limits) -> str | None:
    """The filter a record fails first, or None when it passes them all."""
    out = record["output"]
    n_lines = out.count("\n") + 1
    checks = (
        ("docstring too short", len(doc) < limits.min_doc_chars),
        ("docstring too long", len(doc) > limits.max_doc_chars),
        ("output too short", n_lines < limits.min_output_lines),
        ("output too short", len(out) < limits.min_output_chars),
        ("output too long", n_lines > limits.max_output_lines),
        ("output too long", len(out) > limits.max_output_chars),
        ("record too long", sum(map(len, record.values())) > limits.max_record_chars),
    )
    return next((reason for reason, failed in checks if failed), None)


def file_records(file: Path, module: str, limits: Limits, counts: Counts) -> Iterator[dict]:
    """The records of one source file, filtered, in source order."""
    try:
        with tokenize.open(file) as fh:  # honours a coding cookie, as Python does
            text = fh.read()
        tree = ast.parse(text, filename=str(file))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        counts.unreadable += 1
        return
    lines = _NEWLINE.split(text)
    for owner, node in _definitions(tree.body):
        doc = ast.get_docstring(node, clean=True)
        if not doc:
            continue
        counts.documented += 1
        parts = function_source(lines, node)
        if parts is None:
            counts.dropped["docstring not separable"] += 1
            continue
        record = {
            "instruction": instruction(module, owner, doc),
            "input": parts[0],
            "output": parts[1],
        }
        reason = _too_long_or_short(record, doc, limits)
        if reason:
            counts.dropped[reason] += 1
            continue
        yield record


def build(
    source: Path | None = None, max_examples: int | None = None, limits: Limits = Limits()
) -> tuple[list[dict[str, str]], Counts]:
    """Every kept record under `source` (default: the standard library), deduplicated and
    capped to `max_examples` by evenly spaced picks; and the counts."""
    root = default_corpus_dir() if source is None else Path(source)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a folder"
        raise ConfigError(f"--source {str(root)!r} {what}; give a folder of Python sources")
    counts, records, seen = Counts(), [], set()
    for file in python_files(root):
        counts.files += 1
        for record in file_records(file, _module_name(file, root), limits, counts):
            keys = (record["output"], (record["instruction"], record["input"]))
            if any(key in seen for key in keys):
                counts.duplicates += 1
                continue
            seen.update(keys)
            records.append(record)
    if not records:
        raise ConfigError(
            f"--source {str(root)!r}: no documented public function passes the filters "
            f"({counts.files} .py files, {counts.documented} documented functions)"
        )
    if max_examples is not None and len(records) > max_examples:
        picks = [i * len(records) // max_examples for i in range(max_examples)]
        counts.capped = len(records) - max_examples
        records = [records[i] for i in picks]
    counts.kept = len(records)
    return records, counts


def write_jsonl(records: list[dict[str, str]], path: Path) -> None:
    """One JSON object per line, UTF-8, keys in Alpaca's order."""
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
