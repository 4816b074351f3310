"""lessons.md and lessons.json: each section's rows (expected, measured, ratio) and figures.

The output folder keeps every lesson run there: `--only dp` replaces the dp section and keeps
the others (read back from lessons.json, in the course's order), so re-running one lesson
never deletes the rest. Both files are written whole to a temporary name, then renamed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plait.errors import ConfigError
from plait.lessons.section import Row, Section
from plait.outdir import atomic_file


def _value(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    if unit == "B":
        return f"{int(x):,} B"
    if unit == "x":
        return f"{x:.2f}x"
    if unit == "%":
        return f"{x:.1%}"
    return f"{x:.4g} {unit}"


def _ratio(r: Row) -> str:
    return "-" if math.isnan(r.ratio) else f"{r.ratio:.3f}"


def section_markdown(sec: Section, out: Path) -> str:
    header = "| what | expected (formula) | expected | measured | ratio |"
    lines = [f"## {sec.title}", "", sec.intro, "", header, "|---|---|---|---|---|"]
    for r in sec.rows:
        exp = _value(r.expected, r.unit)
        lines.append(f"| {r.what} | {r.formula} | {exp} | {_value(r.measured, r.unit)} | "
                     f"{_ratio(r)} |")  # fmt: skip
    lines.append("")
    lines += [f"- {note}" for note in sec.notes] + ([""] if sec.notes else [])
    for fig in sec.figures:
        rel = fig.relative_to(out) if fig.is_relative_to(out) else fig
        lines += [f"![{fig.stem}]({rel.as_posix()})", ""]
    return "\n".join(lines)


def previous_sections(out: Path) -> list[dict[str, Any]]:
    """The sections OUT/lessons.json holds (none if it is absent), each with its `quick`.
    ConfigError if the file cannot be read: checked before any lesson runs, so minutes of
    runs never end in a report that cannot be merged."""
    path = out / "lessons.json"
    if not path.exists():
        return []
    try:
        raw = json.loads(path.read_text())
        sections = [dict(s) for s in raw["sections"]]
        for s in sections:
            s.setdefault("quick", bool(raw.get("quick")))
            Section.from_dict(s, out)  # every field a kept section needs is there
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"--out {str(out)!r}: {str(path)!r} cannot be read to keep its lessons "
            f"({type(e).__name__}: {e}); move it away or give another --out"
        ) from None
    return sections


def write_report(sections: Sequence[Section], out: Path, quick: bool,
                 order: Sequence[str] = ()) -> Path:  # fmt: skip
    """OUT/lessons.md (what a reader reads) and OUT/lessons.json (every number, raw): the
    sections just run, and those OUT/lessons.json already held for lessons not re-run; in
    `order` (the course's), names it does not know last."""
    out.mkdir(parents=True, exist_ok=True)
    fresh = {s.name: s.as_dict() | {"quick": quick} for s in sections}
    merged = {d["name"]: d for d in previous_sections(out) if d["name"] not in fresh} | fresh
    rank = {name: i for i, name in enumerate(order)}
    names = sorted(merged, key=lambda n: rank.get(n, len(rank)))
    kept = [merged[n] for n in names]
    modes = {d["quick"] for d in kept}
    commands = {False: "`plait lessons`", True: "`plait lessons --quick`"}
    command = " and ".join(commands[q] for q in sorted(modes))
    if len(modes) > 1:
        command += " (each section's `quick` in lessons.json)"
    head = ["# plait lessons", "", f"Measured by {command} on this machine. Ratio = "
            "measured / expected; rows without a formula are measured ratios.", ""]  # fmt: skip
    body = [section_markdown(Section.from_dict(d, out), out) for d in kept]
    path = out / "lessons.md"
    raw = {"quick": modes == {True}, "sections": kept}
    with atomic_file(out / "lessons.json") as tmp:  # each file whole or not at all
        tmp.write_text(json.dumps(raw, indent=2, default=str))
    with atomic_file(path) as tmp:
        tmp.write_text("\n".join(head + body))
    return path
