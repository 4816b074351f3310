"""What a lesson reports: rows of expected vs measured with their ratio, figures, raw data."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.config import Config
from plait.lessons.measure import measure
from plait.mesh import Mesh

Target = Callable[[Config, Mesh], dict[str, Any]]
"""What every rank of a case's world runs: a module-level function (the launcher pickles it)
that writes OUT/rank{r}.json and returns the same record."""


@dataclass(frozen=True)
class Case:
    """One real run a lesson needs: a label, the full config (its `out` is set by the runner)
    and what every rank runs: plait's training (`measure`) unless the lesson needs another
    measurement (tp's per-phase counts) or another implementation (torch DDP, the peer)."""

    label: str
    cfg: Config
    target: Target = measure


@dataclass(frozen=True)
class Row:
    """One comparison. `expected` is None where there is no closed form (a timing): the row
    then shows the measured value and, in `ratio`, its ratio to the lesson's baseline."""

    what: str
    formula: str
    expected: float | None
    measured: float
    unit: str = "B"
    exact: bool = False  # deterministic: measured must equal expected (bytes, simulated bubbles)

    @property
    def ratio(self) -> float:
        if self.expected is None or self.expected == 0:
            return math.nan if self.expected is None else (1.0 if self.measured == 0 else math.inf)
        return self.measured / self.expected


@dataclass
class Section:
    """A lesson's result: its title, what it teaches, rows, figures (paths under the output
    folder), notes, and the raw per-case data written to JSON."""

    name: str
    title: str
    intro: str
    rows: list[Row] = field(default_factory=list)
    figures: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "intro": self.intro,
            "rows": [vars(r) | {"ratio": r.ratio} for r in self.rows],
            "figures": [str(p) for p in self.figures],
            "notes": self.notes,
            "raw": self.raw,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], out: Path) -> Section:
        """A section as `as_dict` wrote it to OUT/lessons.json (a lesson not re-run keeps its
        place in lessons.md). Figures are found in `out`, where every lesson draws them, so a
        run from another working folder still links them."""
        return cls(
            name=d["name"],
            title=d["title"],
            intro=d.get("intro", ""),  # written since lessons merge; older files lack it
            rows=[Row(**{k: v for k, v in r.items() if k != "ratio"}) for r in d["rows"]],
            figures=[out / Path(f).name for f in d["figures"]],
            notes=list(d["notes"]),
            raw=d["raw"],
        )


@dataclass(frozen=True)
class CaseRun:
    """A case after it ran: its config and one record per rank (see measure.py)."""

    cfg: Config
    records: list[dict[str, Any]]
