"""Pipeline timelines from timing records: a Gantt chart PNG and a Chrome/Perfetto trace.

Both read `TimedAction` records, which the simulator produces and a runtime can measure, so a
simulated and a measured run draw the same way (measured times may start anywhere: charts
start at the earliest record). matplotlib is imported inside the function: it is a heavy,
optional dependency that only charts need.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType

from plait.schedule.actions import Kind, TimedAction

COLORS = MappingProxyType(
    {Kind.F: "#3b75af", Kind.B: "#ef8636", Kind.W: "#519e3e", Kind.STEP: "#7f7f7f"}
)
"""Forward blue, backward orange, weight-gradient green, optimizer step grey."""
IDLE = "#e9e9e9"


def _shade(hex_color: str, level: int) -> str:
    """Lighten a colour by `level` steps (chunk or step number), so chunks stay apart."""
    mix = min(0.45, 0.3 * level)
    rgb = [int(hex_color[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in rgb)


def _shade_note(timings: Sequence[TimedAction]) -> str | None:
    if any(t.action.chunk for t in timings):
        return "lighter: later chunk"
    if any(t.action.step for t in timings):
        return "lighter: later step"
    return None


def gantt_chart(
    timings: Sequence[TimedAction], path: Path, *, title: str = "", time_unit: str = "time"
) -> Path:
    """Draw one row per rank (rank 0 on top): F/B/W bars labelled with their micro-batch, idle
    time as grey background, STEP as a grey tick. Chunks (interleaved) and steps (2bw) are told
    apart by lighter shades. Time starts at the earliest record. Returns the path written.

    Uses a bare matplotlib Figure (Agg), not pyplot: no global backend or figure state."""
    from matplotlib.figure import Figure

    origin = min(float(t.start) for t in timings)
    end = max(float(t.end) for t in timings) - origin
    ranks = 1 + max(t.rank for t in timings)
    fig = Figure(figsize=(min(max(6.0, end * 0.3), 15.0), 0.42 * ranks + 1.1), dpi=100)
    ax = fig.subplots()
    for r in range(ranks):
        ax.barh(r, end, left=0, height=0.8, color=IDLE, linewidth=0)
    for t in timings:
        if t.action.kind in COLORS:
            _draw(ax, t, float(t.start) - origin, end)
    _decorate(ax, timings, ranks, end, title, time_unit)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _draw(ax, t: TimedAction, start: float, end: float) -> None:
    a, width = t.action, float(t.duration)
    if a.kind is Kind.STEP:  # often instantaneous: a tick, so steps mid-stream (2bw) show
        ax.vlines(start, t.rank - 0.45, t.rank + 0.45, color=COLORS[a.kind], linewidth=2.5)
        return
    color = _shade(COLORS[a.kind], a.chunk + a.step)
    ax.barh(t.rank, width, left=start, height=0.8, color=color, edgecolor="white", linewidth=0.6)
    if width >= end * 0.012:  # label only bars wide enough to hold it
        label = str(a.microbatch)
        ax.text(start + width / 2, t.rank, label, ha="center", va="center", fontsize=7, color="w")


def _decorate(ax, timings, ranks: int, end: float, title: str, time_unit: str) -> None:
    from matplotlib.patches import Patch

    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, end * 1.005)
    ax.set_xlabel(time_unit)
    kinds = {t.action.kind for t in timings}
    legend = [Patch(color=COLORS[k], label=k.value) for k in COLORS if k in kinds]
    legend.append(Patch(color=IDLE, label="idle"))
    ax.legend(
        handles=legend,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
        title=_shade_note(timings),
        title_fontsize=7,
    )
    ax.spines[["top", "right", "left"]].set_visible(False)
    if title:
        ax.set_title(title, fontsize=10, loc="left")


def trace_events(timings: Sequence[TimedAction], us_per_unit: float = 1e6) -> dict:
    """Chrome trace JSON object: one process per rank, compute on thread 0, p2p on thread 1.

    `us_per_unit` converts the records' time unit to microseconds (1e6 for seconds).
    """
    events: list[dict] = []
    for r in sorted({t.rank for t in timings}):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        for tid, label in ((0, "compute"), (1, "p2p")):
            events.append(
                {"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": label}}
            )
    for t in timings:
        a = t.action
        events.append(
            {
                "name": str(a),
                "cat": a.kind.value,
                "ph": "X",
                "ts": float(t.start) * us_per_unit,
                "dur": float(t.duration) * us_per_unit,
                "pid": t.rank,
                "tid": 1 if a.is_comm else 0,
                "args": {
                    "microbatch": a.microbatch,
                    "chunk": a.chunk,
                    "step": a.step,
                    "version": a.version,
                    "peer": a.peer,
                    "index": t.index,
                },
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(timings: Sequence[TimedAction], path: Path, us_per_unit: float = 1e6) -> Path:
    """Write trace_events() to `path` (open it in ui.perfetto.dev or chrome://tracing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace_events(timings, us_per_unit)))
    return path
