"""Run summary figures (telemetry.py), without processes."""

from __future__ import annotations

import pytest

from plait.telemetry import RunSummary


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
