"""The estimate against what runs measure (memory tracker by category), on a representative
subset of layouts in one 2-rank world: model states within 2%, activations and the total
within 10% (docs/memory.md has the whole table, from benchmarks/bench_memory.py)."""

from __future__ import annotations

import pytest

from memory_runs import Case, compare, error, measure
from plait.estimate import estimate
from plait.plan.traffic import step_collectives
from plait.schedule.stages import rank_plans

SUBSET = [
    Case("dp2 zero1 bf16", parallel={"dp": 2, "zero": 1, "precision": "bf16"}),
    Case("dp2 zero3 bf16", parallel={"dp": 2, "zero": 3, "precision": "bf16"}),
    Case(
        "dp2 zero2 cpu-offload full-recompute",
        "small-llama",
        parallel={"dp": 2, "zero": 2, "offload": "cpu", "recompute": "full"},
    ),
    Case(
        "tp2 sp selective dropout",
        "small-llama",
        parallel={"tp": 2, "sequence_parallel": True, "recompute": "selective"},
        model={"dropout": 0.1},
    ),
    Case("pp2 1f1b", parallel={"pp": 2, "schedule": "1f1b"}, accum=4),
    Case(
        "pp2 interleaved",
        "small-llama",
        parallel={"pp": 2, "schedule": "interleaved", "virtual_stages": 2},
        accum=4,
    ),
]
LIMITS = {"activations": 0.10, "total": 0.10}  # model states: 0.02


@pytest.mark.parametrize("layout", SUBSET, ids=[x.name for x in SUBSET])
def test_estimate_matches_measurement(world2, layout):
    est = estimate(layout.config())
    for measured in world2.run(measure, layout):
        for term, pair in compare(est, measured).items():
            limit = LIMITS.get(term, 0.02)
            assert abs(error(pair)) <= limit, (layout.name, measured["pp_rank"], term, pair)
        assert _small_collectives(measured) == _planned(layout, measured["pp_rank"])


STEP_TAGS = ("loss", "grad_norm", "tied_embedding", "tp-sp-grads")


def _small_collectives(measured: dict) -> dict:
    """{(axis, tag): (calls, elements, bytes per element)} this rank counted in its step."""
    rows = [r for r in measured["comm"] if r["tag"] in STEP_TAGS]
    assert all(r["op"] == "all_reduce" for r in rows), rows
    return {(r["axis"], r["tag"]): (r["calls"], r["elements"], r["bytes"] // r["elements"])
            for r in rows}  # fmt: skip


def _planned(layout: Case, pp_rank: int) -> dict:
    """What `plait plan` prices for that rank (plan/traffic.py `step_collectives`)."""
    cfg = layout.config()
    par = cfg.parallel
    sizes = par.stage_layer_counts()
    plans = rank_plans(cfg.model.n_layers, par.pp, par.virtual_stages, pp_rank, sizes)
    return step_collectives(cfg, plans)
