"""lessons.md and lessons.json: each section's rows (expected, measured, ratio) and figures."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from plait.lessons.section import Row, Section


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


def write_report(sections: Sequence[Section], out: Path, quick: bool) -> Path:
    """OUT/lessons.md (what a reader reads) and OUT/lessons.json (every number, raw)."""
    out.mkdir(parents=True, exist_ok=True)
    command = f"plait lessons{' --quick' if quick else ''}"
    head = ["# plait lessons", "", f"Measured by `{command}` on this machine. Ratio = "
            "measured / expected; rows without a formula are measured ratios.", ""]  # fmt: skip
    body = [section_markdown(s, out) for s in sections]
    path = out / "lessons.md"
    path.write_text("\n".join(head + body))
    raw = {"quick": quick, "sections": [s.as_dict() for s in sections]}
    (out / "lessons.json").write_text(json.dumps(raw, indent=2, default=str))
    return path
