"""plait's step-time model against published GPU runs (docs/planning.md "Published runs").

Pure and deterministic: the rows, their predictions, the H100 profile's fitted `achievable`
and the table the docs show, with no processes started.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from plait.models.transformer import matmul_flops_per_token
from plait.plan.hardware import load_hardware
from plait.plan.published_runs import (
    HELD_BACK,
    MEGATRON,
    Prediction,
    fit_rows,
    fitted_achievable,
    predict,
    published_runs,
    published_table,
)
from plait.plan.step_time import TERMS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "planning.md"


@pytest.fixture(scope="module")
def predictions() -> dict[str, Prediction]:
    return {r.key: predict(r) for r in published_runs()}


def test_every_prediction_is_within_its_stated_band(predictions):
    """Predicted over published tokens/s/GPU within each row's band (docs state them)."""
    for key, p in predictions.items():
        assert abs(p.ratio - 1) <= p.run.band, (key, p.ratio, p.run.band)
    megatron = [p for p in predictions.values() if p.run.source == MEGATRON]
    assert len(megatron) == 9 and all(p.run.band == 0.15 for p in megatron)


def test_the_held_back_row_is_outside_the_fit_and_lands_close(predictions):
    """The check: the row left out of the fit predicts its throughput within 5%."""
    assert HELD_BACK not in {r.key for r in fit_rows()}
    assert [r.key for r in fit_rows()] == ["megatron-1.7b", "megatron-16b", "megatron-32b"]
    assert predictions[HELD_BACK].ratio == pytest.approx(1.0, abs=0.05)


def test_h100_achievable_is_what_the_published_rows_give():
    """The shipped profile's `achievable` is the fit, rounded to two places; with the old
    assumed 0.55 the torchtitan row was 49% optimistic, outside its band."""
    hw = load_hardware("h100")
    assert round(fitted_achievable(hw), 2) == hw.achievable == 0.47
    titan = next(r for r in published_runs() if r.key == "torchtitan-8b")
    old = predict(titan, replace(hw, achievable=0.55))
    assert old.ratio > 1 + titan.band and old.mfu(hw) == pytest.approx(0.504, abs=0.001)


def test_megatron_throughput_follows_its_flop_formula():
    """Megatron's TFLOP/s become tokens/s through 72Lh^2 + 12Lsh + 6Vh per token (its
    formula then), which is plait's 6N + 12Lsh; the table's 7.1B is 7.11B parameters with
    untied embeddings."""
    row = next(r for r in published_runs() if r.key == "megatron-7.1b")
    m, s = row.model(), row.seq_len
    h, n, v = m.d_model, m.n_layers, m.vocab_size
    assert matmul_flops_per_token(m, s) == 72 * n * h * h + 12 * n * s * h + 6 * v * h
    assert row.published_tokens() == pytest.approx(465.9e12 / matmul_flops_per_token(m, s))
    assert (12 * n * h * h + 2 * v * h) / 1e9 == pytest.approx(7.11, abs=0.005)


def test_overlap_takes_out_only_the_named_terms(predictions):
    """The comparison hides what the framework overlaps by its flags, nothing else; the
    as-run time is plait's full prediction."""
    for p in predictions.values():
        hidden = sum(getattr(p.time, k) for k in p.run.overlapped)
        assert set(p.run.overlapped) <= set(TERMS)
        assert p.step == pytest.approx(p.time.total - hidden)
        assert p.tokens_per_gpu(p.time.total) <= p.tokens_per_gpu()
    assert predictions["megatron-32b"].time.tp > 0 and predictions["llama-65b"].hidden == 0


def test_an_unpublished_schedule_is_the_fastest_plait_offers(predictions):
    row = next(r for r in published_runs() if r.key == "megatron-177b")
    picked = predictions[row.key]
    for schedule, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 4)):
        other = predict(replace(row, schedule=schedule, virtual_stages=v))
        assert picked.step <= other.step + 1e-12, (schedule, v)


def test_the_docs_table_is_the_generated_one(predictions):
    """docs/planning.md shows exactly what `python -m plait.plan.published_runs` prints."""
    text = DOCS.read_text()
    start = text.index("<!-- published-table:")
    body = text[text.index("\n", start) + 1 : text.index("<!-- /published-table -->")]
    assert body.strip() == published_table(list(predictions.values())).strip()
