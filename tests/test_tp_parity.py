"""Tensor parallelism through the Trainer reproduces single-process training exactly (fp32).

tp in {2, 4}, with and without sequence parallelism, composed with dp and pp, GPT-2 (tied,
learned positions) and LLaMA (untied, GQA) variants: loss and gradient norm every step, the
validation loss, and every parameter (shards gathered) after 10 steps equal the plain
single-process loop's.
"""

from __future__ import annotations

import pytest
import torch

from plait.mesh import build_mesh
from plait.parallel.tp.sharding import full_tensor, param_shard_specs
from plait.train import Trainer
from reference import assert_matches_reference, corpus_for, small_config

RTOL = 1e-5
PARAM_ATOL = 5e-5  # Adam and summation order; see test_pp_parity.py


def _tp_parity(steps: int = 10, sequence_parallel: bool = False, **kw) -> dict:
    cfg = small_config(steps=steps, **kw)
    cfg.parallel.sequence_parallel = sequence_parallel
    cfg.validate()
    corpus = corpus_for(cfg)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus)
    results = [trainer.train_step() for _ in range(cfg.train.steps)]
    val = trainer.evaluate()
    specs = param_shard_specs(trainer.model)
    params = {
        n: full_tensor(p, specs[n], trainer.comm) if n in specs else p.detach().clone()
        for n, p in trainer.model.named_parameters()
    }
    stats_ops = sorted({r["op"] for r in trainer.comm.stats.as_rows() if r["axis"] == "tp"})
    trainer.close()
    assert_matches_reference(cfg, corpus, results, params, val, PARAM_ATOL)
    return {"sharded": sorted(specs), "tp_ops": stats_ops}


def _id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


TP2 = [
    dict(preset="tiny-gpt", tp=2, accum=2),
    dict(preset="tiny-llama", tp=2, sequence_parallel=True),
    dict(preset="tiny-gpt", tp=2, sequence_parallel=True, dropout=0.1, recompute="selective"),
    dict(preset="tiny-llama", tp=2, dropout=0.1, recompute="full", accum=2),
]


@pytest.mark.parametrize("case", TP2, ids=_id)
def test_tp2_matches_single_process(world2, case):
    out = world2.run(_tp_parity, **case)[0]
    assert "blocks.0.attn.wq.weight" in out["sharded"]
    expected = {"all_gather", "reduce_scatter"} if case.get("sequence_parallel") else set()
    assert expected <= set(out["tp_ops"]) and "all_reduce" in out["tp_ops"]


WORLD4 = [
    dict(preset="tiny-gpt", tp=4),
    dict(preset="tiny-gpt", tp=4, sequence_parallel=True, dropout=0.1),
    dict(preset="tiny-llama", dp=2, tp=2, accum=2),
    dict(preset="tiny-gpt", dp=2, tp=2, sequence_parallel=True, dropout=0.1),
    dict(preset="tiny-gpt", pp=2, tp=2, accum=4, schedule="1f1b"),
    dict(preset="tiny-llama", pp=2, tp=2, accum=4, schedule="zb-h1", sequence_parallel=True),
]


@pytest.mark.parametrize("case", WORLD4, ids=_id)
def test_world4_tensor_parallel_layouts_match_single_process(world4, case):
    world4.run(_tp_parity, **case)
