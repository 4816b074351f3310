"""What a run shows and writes: per-step metrics (JSONL, optional TensorBoard), a progress bar
and the final summary, all from rank 0. Files are flushed every line so nothing written is
lost when a run dies."""

from __future__ import annotations

import json
import math
import signal
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text


class MetricsLog:
    """Appends one JSON object per line to OUT/metrics.jsonl, and to TensorBoard if asked."""

    def __init__(self, out: Path, tensorboard: bool, keep_before: int | None = None) -> None:
        """`keep_before`: a resumed run keeps the rows of the steps before it (a run that
        crashed after its checkpoint wrote rows the resumed run writes again)."""
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "metrics.jsonl"
        kept = []
        if keep_before is not None and self.path.exists():
            lines = self.path.read_text().splitlines()
            kept = [line for line in lines if json.loads(line)["step"] < keep_before]
        self._fh = self.path.open("w")
        for line in kept:
            self._fh.write(line + "\n")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency

            self._tb = SummaryWriter(log_dir=str(out / "tensorboard"))

    def write(self, row: dict[str, Any]) -> None:
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for key, value in _scalars(row):
                self._tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


def _scalars(row: dict[str, Any], prefix: str = ""):
    for key, value in row.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            yield prefix + key, value
        elif isinstance(value, dict):
            yield from _scalars(value, prefix + key + "/")


def make_progress(console: Console, total: int, label: str = "train") -> Progress:
    """The bar of `plait train` (and, labelled `eval`, of `plait eval`), on rank 0."""
    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


@dataclass
class RunSummary:
    """Numbers the final table shows; also returned to callers and written as summary.json."""

    layout: str
    params: int
    steps: int
    tokens_per_step: int
    final_loss: float
    val_loss: float | None
    unigram_baseline: float
    step_times: list[float] = field(default_factory=list)
    flops_per_token: int = 0
    peak_flops: float | None = None
    world_size: int = 1
    comm_bytes_per_step: dict[str, int] = field(default_factory=dict)
    pipeline: dict | None = None  # measured vs simulated bubble, with --trace
    model_state_bytes: int | None = None  # per rank, with the ZeRO engine
    checkpoint: str | None = None  # the last checkpoint written
    restarts: int = 0  # times the world was started again after a failure
    stopped_by: int | None = None  # the signal that stopped the run early
    steps_done: int = 0  # the steps trained so far (fewer than `steps` after a stop)
    val_step: int | None = None  # the steps done when `val_loss` was measured
    out: str = ""  # the run's folder (the summary's hint of how to continue a stopped run)
    skipped_steps: int = 0  # optimizer steps skipped: fp16 overflow or --nan-policy skip
    sample: dict[str, str] | None = None  # {"prompt", "text"}: the trained model writing
    token_kind: str = "byte"  # what a token is: "byte", or "BPE token" with a tokenizer
    trainable_params: int = 0  # the parameters the optimizer updates (LoRA: the adapters)
    step_targets: list[int] = field(default_factory=list)  # target tokens of each timed step
    best_step: int | None = None  # --keep-best: the steps done at the best validation
    best_val_loss: float | None = None
    best_checkpoint: str | None = None
    epochs: int = 0  # --epochs (0: the steps were given)

    @property
    def median_step_s(self) -> float:
        times = self.step_times[1:] or self.step_times  # the first step pays for warm-up
        return statistics.median(times) if times else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.median_step_s

    def recent_tokens_per_s(self, window: int = 50) -> float:
        """Throughput of the median of the last `window` steps, for the progress bar: one
        slow or instant step (a validation, 2BW's drain at the end) does not move it."""
        recent = self.step_times[1:][-window:] or self.step_times
        return self.tokens_per_step / statistics.median(recent)

    @property
    def target_tokens_per_s(self) -> float:
        """Target tokens (those the loss counts: an instruction run's responses) per second:
        their mean per step over the median step time, both without the first step (it pays
        for warm-up), as `tokens_per_s` counts every token (equal on text, where every token
        is a target)."""
        if not self.step_targets or len(self.step_targets) != len(self.step_times):
            return float("nan")  # not counted (a summary built by hand)
        targets = self.step_targets[1:] or self.step_targets
        return statistics.fmean(targets) / self.median_step_s

    @property
    def mfu(self) -> float | None:
        if not self.peak_flops:
            return None
        return self.tokens_per_s * self.flops_per_token / (self.peak_flops * self.world_size)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k not in ("step_times", "step_targets")}
        targets = self.target_tokens_per_s
        d.update(median_step_s=self.median_step_s, tokens_per_s=self.tokens_per_s, mfu=self.mfu,
                 target_tokens_per_s=targets if math.isfinite(targets) else None)  # fmt: skip
        return d


def summary_table(s: RunSummary) -> Table:
    table = Table(title="plait run summary", show_header=False)
    table.add_row("layout", s.layout)
    table.add_row("parameters", f"{s.params:,}")
    share = s.trainable_params / s.params if s.params else 0.0
    table.add_row("trainable parameters", f"{s.trainable_params:,} ({share:.2%})")
    stopped = s.stopped_by is not None
    if stopped:
        name = signal.Signals(s.stopped_by).name
        table.add_row("steps", f"{s.steps_done} of {s.steps} (stopped by {name})")
    else:
        table.add_row("steps", str(s.steps) + (f" ({s.epochs} epochs)" if s.epochs else ""))
    if s.restarts:
        table.add_row("restarts", f"{s.restarts} (from the newest checkpoint)")
    if s.skipped_steps:
        table.add_row("skipped steps", f"{s.skipped_steps} (non-finite loss or gradients)")
    table.add_row("final train loss", f"{s.final_loss:.4f} nats/token")
    baseline = f"{s.unigram_baseline:.4f} nats/token ({s.token_kind} frequencies, no context)"
    table.add_row("unigram baseline", baseline)
    if s.val_loss is not None:
        gap = s.unigram_baseline - s.val_loss
        verdict = "below" if gap > 0 else "NOT below"
        when = f" (after step {s.val_step})" if s.val_step not in (None, s.steps_done) else ""
        line = f"{s.val_loss:.4f}: {abs(gap):.3f} {verdict} baseline{when}"
        table.add_row("validation loss", line)
    if s.best_step is not None:
        where = f" ({s.best_checkpoint})" if s.best_checkpoint else ""
        table.add_row("best validation", f"{s.best_val_loss:.4f} after step {s.best_step}{where}")
    table.add_row("median step", f"{s.median_step_s * 1e3:.1f} ms")
    table.add_row("throughput", f"{s.tokens_per_s:,.0f} tokens/s")
    if math.isfinite(s.target_tokens_per_s):
        targets = f"{s.target_tokens_per_s:,.0f} tokens/s (those the loss counts)"
        table.add_row("target tokens", targets)
    flops = s.tokens_per_s * s.flops_per_token
    mfu = f" (MFU {s.mfu:.1%})" if s.mfu is not None else ""
    table.add_row("model FLOP/s", f"{flops / 1e9:.2f} GFLOP/s{mfu}")
    for op, nbytes in sorted(s.comm_bytes_per_step.items()):
        table.add_row(f"{op} per step", f"{nbytes / 2**20:.2f} MiB")
    if s.model_state_bytes is not None:
        table.add_row("model states per rank", f"{s.model_state_bytes / 2**20:.2f} MiB")
    if s.pipeline:
        bubble = f"{s.pipeline['measured_bubble']:.1%} measured"
        bubble += f", {s.pipeline['simulated_bubble']:.1%} simulated from measured costs"
        table.add_row(f"pipeline bubble ({s.pipeline['schedule']})", bubble)
    if stopped and s.checkpoint:
        table.add_row("to continue", f"the same command with --resume latest --out {s.out}")
    if s.sample:  # Text: markup stays text; readable(): one line per cell, no quoting
        table.add_row("sample prompt", Text(readable(s.sample["prompt"])))
        table.add_row("sample continuation", Text(readable(s.sample["text"])))
    return table


def readable(text: str) -> str:
    """`text` on one line, as it reads: a newline shows as ⏎ and a tab as →, so the table's
    rows stay rows; any other control character shows as its escape (a sample from a barely
    trained model holds any byte), everything else as itself, unquoted."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("⏎")
        elif ch == "\t":
            out.append("→")
        elif ch.isprintable() or ch == " ":
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)
