"""The lessons' figures: grouped bar charts and line plots, PNG through matplotlib's Agg."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a training machine
import matplotlib.pyplot as plt


def bars(
    path: Path, groups: Sequence[str], series: Mapping[str, Sequence[float]], title: str,
    ylabel: str,
) -> Path:  # fmt: skip
    """Grouped bars: one group per label in `groups`, one bar per series within it."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
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


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
