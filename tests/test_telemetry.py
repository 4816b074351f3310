"""Run summary figures (telemetry.py), without processes."""

from __future__ import annotations

import io
import signal

import pytest
from rich.console import Console

from plait.telemetry import RunSummary, readable, summary_table


def test_progress_throughput_is_a_running_median() -> None:
    """One instant step (2BW's last update after the drain) or one slow step (a validation)
    does not move the progress bar's tokens/s; the first step (warm-up) is left out."""
    summary = RunSummary(
        layout="dp=1", params=1, steps=10, tokens_per_step=1000, final_loss=0.0, val_loss=None,
        unigram_baseline=0.0, flops_per_token=1, peak_flops=None,
    )  # fmt: skip
    summary.step_times = [5.0, 0.1, 0.1, 0.1, 9.0, 0.1, 0.001]
    assert summary.recent_tokens_per_s() == pytest.approx(1000 / 0.1)
    assert summary.recent_tokens_per_s(window=2) == pytest.approx(1000 / 0.0505)


def _summary(**kw: object) -> RunSummary:
    return RunSummary(
        layout="dp=1", params=1, steps=1, tokens_per_step=1, final_loss=1.0, val_loss=None,
        unigram_baseline=2.0, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _rendered(summary: RunSummary) -> str:
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(summary_table(summary))
    return console.export_text()


def test_readable_keeps_a_sample_on_one_unquoted_line() -> None:
    assert readable("a\nb\tc") == "a⏎b→c"
    assert readable("it's \x00 [bold]é") == "it's \\x00 [bold]é"


def test_summary_sample_rows_are_text_without_repr_or_broken_rows() -> None:
    """A sample with newlines and markup gives one row each for prompt and continuation,
    shown as text: no quotes, no escaped newlines splitting the table's rows."""
    out = _rendered(_summary(sample={"prompt": "Once\nupon", "text": " a [red]time\n"}))
    prompt = next(line for line in out.splitlines() if "sample prompt" in line)
    assert "Once⏎upon" in prompt and "'" not in prompt
    continuation = next(line for line in out.splitlines() if "sample continuation" in line)
    assert "a [red]time⏎" in continuation


@pytest.mark.parametrize("kind", ["byte", "BPE token"])
def test_unigram_baseline_names_what_the_tokens_are(kind: str) -> None:
    out = _rendered(_summary(token_kind=kind))
    assert f"({kind} frequencies, no context)" in out


def test_a_stopped_runs_summary_says_what_was_done_and_how_to_continue() -> None:
    """The steps done of those planned, the signal named, a validation loss older than the
    stop marked with its step, and the flags that continue the run; a finished run shows
    none of it."""
    summary = RunSummary(
        layout="dp=2", params=1, steps=100, tokens_per_step=1000, final_loss=2.0, val_loss=2.5,
        unigram_baseline=3.0, flops_per_token=1, peak_flops=None, step_times=[0.1, 0.1],
    )  # fmt: skip
    summary.steps_done = summary.val_step = 100
    finished = _rendered(summary)
    assert "│ 100 " in finished and "stopped" not in finished and "after step" not in finished
    assert "--resume" not in finished
    summary.stopped_by, summary.steps_done, summary.val_step = signal.SIGTERM, 41, 40
    summary.checkpoint, summary.out = "runs/x/checkpoints/step-41", "runs/x"
    stopped = _rendered(summary)
    assert "41 of 100 (stopped by SIGTERM)" in stopped
    assert "0.500 below baseline (after step 40)" in stopped
    assert "the same command with --resume latest --out runs/x" in stopped
    summary.checkpoint = None  # --no-save: nothing to continue from
    assert "--resume" not in _rendered(summary)
