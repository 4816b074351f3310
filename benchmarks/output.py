"""Shared output of the benchmarks: markdown tables, the pieces every report repeats (machine
line, step-time columns, verdict line, phase table) and saving the JSON.

Nothing here measures; `summarize.py` also uses it to re-render saved results.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:,.1f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def save_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"saved {path}")


def describe_machine_md(m: dict[str, Any]) -> str:
    return (
        f"{m['cpu']}, {m['cores']} usable cores, {m['os']}, "
        f"Python {m['python']}, torch {m['torch']}"
    )


def machine_line(res: dict[str, Any], threads: int, per_rank: bool = True) -> str:
    """'Machine: ...; N thread(s)/rank', the line under every report's title."""
    return f"Machine: {describe_machine_md(res['machine'])}; {threads} thread(s)" + (
        "/rank" if per_rank else ""
    )


TIME_COLUMNS = ("median step ms", "min ms", "p25 ms", "p75 ms", "steps")


def time_cells(s: dict[str, Any]) -> list[Any]:
    """One side's `summarize` figures in the order of TIME_COLUMNS."""
    return [s["median_ms"], s["min_ms"], s["p25_ms"], s["p75_ms"], s["steps"]]


def comparison_cells(r: dict[str, Any], a: dict[str, Any], b: dict[str, Any]) -> list[Any]:
    """The cells every summary row starts with: both medians, the ratio (bold), the paired
    per-round ratio and both minima; `r` holds the ratios, `a` and `b` the two sides."""
    return [
        a["median_ms"],
        b["median_ms"],
        f"**{r['ratio_of_medians']:.3f}**",
        r["paired_block_ratio"],
        f"{a['min_ms']:.1f} / {b['min_ms']:.1f}",
    ]


def ratio_line(res: dict[str, Any], peer: str, target: float) -> str:
    """The verdict: plait/peer by median step against the target, and the paired ratio."""
    ratio = res["ratio_of_medians"]
    verdict = "meets" if ratio <= target else "misses"
    return (
        f"ratio plait/{peer} (median step): **{ratio:.3f}** ({verdict} target <= {target}); "
        f"median of per-round ratios {res['paired_block_ratio']:.3f}"
    )


def phase_table(
    first: str,
    phases: Sequence[str],
    rows: Sequence[tuple[str, dict[str, Any]]],
    key: str = "phases_median_ms",
) -> str:
    """Median per-phase ms, one row per (label, side results) in `rows`."""
    return markdown_table(
        [first, *phases], [[label, *(s[key][k] for k in phases)] for label, s in rows]
    )


def ddp_bucket_sizes(d: dict[str, Any]) -> list[int]:
    """DDP's bucket sizes in bytes from its logging data (rebuilt after the first step)."""
    sizes = d.get("rebuilt_bucket_sizes") or d.get("bucket_sizes") or ""
    return [int(x) for x in str(sizes).split(",") if x.strip()]


def command_line() -> str:
    """How this run was started, for the JSON."""
    return "python " + " ".join(sys.argv)


def publish(res: dict[str, Any], text: str, path: str | None) -> None:
    """Print the report, then save the results (with the command line, unless set)."""
    res.setdefault("command", command_line())
    print(text)
    save_json(path, res)
