"""Pipeline parallelism reproduces single-process training exactly (fp32).

Every synchronous schedule, pp in {2, 4}, pp2 x dp2, tied and untied embeddings, uneven
stage splits: loss and gradient norm every step and parameters after 10 steps equal the
plain single-process loop's. Parameters are compared by name (each rank holds its stages).
"""

from __future__ import annotations

import pytest
import torch

from plait.mesh import build_mesh
from plait.train import Trainer
from reference import assert_matches_reference, corpus_for, small_config

RTOL = 1e-5
# Parameters need an absolute tolerance (see test_dp_parity.py): Adam turns rounding-level
# gradient differences into ~1e-6 parameter differences, and summing up to 6 micro-batches
# in another order than one big batch leaves rare elements (1 in 4096 seen) near 2e-5.
# Scaling bugs are caught by the gradient norm, compared every step at rtol 1e-5.
PARAM_ATOL = 5e-5


def _pp_parity(steps: int = 10, **kw) -> dict:
    cfg = small_config(steps=steps, **kw)
    corpus = corpus_for(cfg)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus)
    results = [trainer.train_step() for _ in range(cfg.train.steps)]
    val = trainer.evaluate()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.close()
    assert_matches_reference(cfg, corpus, results, params, val, PARAM_ATOL)
    return {"names": sorted(params), "loss": results[-1].loss}


def _id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


PP2 = [
    dict(preset="tiny-gpt", schedule="naive", accum=2),
    dict(preset="tiny-gpt", schedule="gpipe", accum=4),
    dict(preset="tiny-gpt", schedule="1f1b", accum=4),
    dict(preset="tiny-llama", schedule="1f1b", accum=3),
    dict(preset="tiny-gpt", schedule="zb-h1", accum=4),
    dict(preset="tiny-llama", schedule="zb-h1", accum=2, recompute="full", dropout=0.1),
    dict(preset="tiny-gpt", schedule="1f1b", accum=2, recompute="selective", dropout=0.1),
]


@pytest.mark.parametrize("case", PP2, ids=_id)
def test_pp2_matches_single_process(world2, case):
    out = world2.run(_pp_parity, pp=2, **case)
    assert out[0]["loss"] == out[1]["loss"]
    assert not set(out[0]["names"]) & set(out[1]["names"]) - {"head.weight", "embed.tok.weight"}


def test_pp2_interleaved_uneven(world2):
    world2.run(_pp_parity, preset="tiny-gpt", pp=2, schedule="interleaved", virtual_stages=2,
               accum=4, n_layers=4, stage_layers="1,1,1,1")  # fmt: skip
    world2.run(_pp_parity, preset="tiny-gpt", pp=2, schedule="1f1b", accum=2, n_layers=3,
               stage_layers="2,1")  # fmt: skip


PP4 = [
    dict(pp=4, schedule="1f1b", accum=4, n_layers=4),
    dict(pp=4, schedule="interleaved", virtual_stages=2, accum=4, n_layers=8),
    dict(pp=4, schedule="zb-h1", accum=6, n_layers=4, preset="tiny-llama"),
    dict(pp=2, dp=2, schedule="1f1b", accum=2),
    dict(pp=2, dp=2, schedule="zb-h1", accum=3, dropout=0.1),
]


@pytest.mark.parametrize("case", PP4, ids=_id)
def test_world4_pipelines_match_single_process(world4, case):
    world4.run(_pp_parity, **case)
