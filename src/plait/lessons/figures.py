"""The lessons' figures: grouped bar charts and line plots, PNG through matplotlib's Agg."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a training machine
import matplotlib.pyplot as plt


def bars(
    path: Path, groups: Sequence[str], series: Mapping[str, Sequence[float]], title: str,
    ylabel: str, marks: Mapping[str, Sequence[float]] | None = None,
) -> Path:  # fmt: skip
    """Grouped bars: one group per label in `groups`, one bar per series within it; `marks`
    (same keys) draws a black tick across each bar at what was expected of it."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name)
        if marks and name in marks:
            ax.hlines(marks[name], [x - width / 2 for x in xs], [x + width / 2 for x in xs],
                      colors="black", linewidth=2)  # fmt: skip
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    if marks:  # beside the plot: the tallest bars are the ones a reader compares
        ax.plot([], [], color="black", linewidth=2, label="expected")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        ax.legend(fontsize=8)
    return _save(fig, path)


def lines(
    path: Path, series: Mapping[str, Sequence[float]], title: str, ylabel: str,
    log: bool = False,
) -> Path:  # fmt: skip
    """One line per series over the step number."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, values in series.items():
        ax.plot(range(len(values)), values, label=name, marker=".")
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def points(
    path: Path, measured: Mapping[str, tuple[float, float]], title: str, xlabel: str,
    ylabel: str, expected: Mapping[str, tuple[float, float]] | None = None,
) -> Path:  # fmt: skip
    """One labelled point (x, y) per series, e.g. memory against time per mode; `expected`
    (same keys): a hollow ring where it was predicted. Both axes start at 0, so distances
    read as ratios."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (name, (x, y)) in enumerate(measured.items()):
        ax.scatter([x], [y], color=f"C{i}", s=60, zorder=3)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(8, 6), fontsize=9)
        if expected and name in expected:
            ax.scatter(*expected[name], facecolors="none", edgecolors=f"C{i}", s=180)
    ax.scatter([], [], color="gray", s=60, label="measured")
    if expected:
        ax.scatter([], [], facecolors="none", edgecolors="gray", s=180, label="expected")
    ax.set_xlim(left=0, right=max(x for x, _ in measured.values()) * 1.15)
    ax.set_ylim(bottom=0, top=max(y for _, y in measured.values()) * 1.15)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="best")  # clear of the points
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
