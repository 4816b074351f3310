"""ZeRO on a model split by tensor and pipeline parallelism reproduces single-process training.

fp32, a world of 4: stages 1-3 with dp2 x tp2 (with and without sequence parallelism, whose
replicated-parameter sums run on the gradient shards), and stage 1 with dp2 x pp2 (the tied
embedding's two copies summed on their shards; zb-h1's split backward; interleaving). Loss
and gradient norm every step, validation loss, and every parameter (dp shards and tp shards
gathered) after 10 steps equal the plain loop's. Mixed precision through the pipeline
(activations in the compute dtype, fp16's loss scale on the last stage) is checked against
the fp32 run's first steps, which a missing scale or unscale would be far from.
"""

from __future__ import annotations

import pytest
import torch

from plait.errors import ConfigError
from plait.mesh import build_mesh
from plait.train import Trainer
from reference import assert_matches_reference, corpus_for, reference_run, small_config
from sections import build_regrouped
from whole_params import whole_params

PARAM_ATOL = 5e-5  # see test_pp_parity.py


def _trainer(zero: int, precision: str = "fp32", sequence_parallel: bool = False, **kw):
    cfg = small_config(**kw)
    cfg.memory.zero, cfg.train.precision = zero, precision
    cfg.parallel.sequence_parallel = sequence_parallel
    cfg.validate()
    corpus = corpus_for(cfg)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    return cfg, corpus, Trainer(cfg, mesh, corpus)


def _zero_split_parity(zero: int, **kw) -> dict:
    cfg, corpus, trainer = _trainer(zero, **kw)
    results = [trainer.train_step() for _ in range(cfg.train.steps)]
    val = trainer.evaluate()
    params = whole_params(trainer)
    groups = [g.names for g in trainer.engine.groups]
    trainer.close()
    assert_matches_reference(cfg, corpus, results, params, val, PARAM_ATOL)
    return {"groups": groups, "loss": results[-1].loss}


def _id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


WORLD4 = [
    dict(zero=1, preset="tiny-gpt", dp=2, tp=2, accum=2),
    dict(zero=2, preset="tiny-llama", dp=2, tp=2, sequence_parallel=True),
    dict(zero=3, preset="tiny-gpt", dp=2, tp=2, sequence_parallel=True, dropout=0.1, accum=2),
    dict(zero=1, preset="tiny-gpt", dp=2, pp=2, accum=4, schedule="1f1b"),
    dict(zero=1, preset="tiny-llama", dp=2, pp=2, accum=4, schedule="zb-h1"),
    dict(
        zero=1,
        preset="tiny-gpt",
        dp=2,
        pp=2,
        accum=4,
        schedule="interleaved",
        virtual_stages=2,
        n_layers=4,
    ),
]


@pytest.mark.parametrize("case", WORLD4, ids=_id)
def test_zero_with_tp_or_pp_matches_single_process(world4, case):
    out = world4.run(_zero_split_parity, **case)
    assert len({o["loss"] for o in out}) == 1
    if case.get("pp", 1) > 1 and case["preset"] == "tiny-gpt":  # tied copies: a group each
        for rank_groups in out:
            tied = [g for g in rank_groups["groups"] if "embed.tok.weight" in g]
            assert tied in ([], [["embed.tok.weight"]]), tied


def _mixed_pipeline(precision: str, **kw) -> dict:
    cfg, corpus, trainer = _trainer(1, precision, steps=3, **kw)
    results = [trainer.train_step() for _ in range(cfg.train.steps)]
    scale = trainer.engine.loss_scale
    dtypes = {str(p.dtype) for p in trainer.model.parameters()}
    trainer.close()
    ref_losses, ref_norms, _ = reference_run(cfg, corpus)
    return {
        "losses": [r.loss for r in results],
        "norms": [r.grad_norm for r in results],
        "ref_losses": ref_losses,
        "ref_norms": ref_norms,
        "scale": scale,
        "dtypes": dtypes,
    }


@pytest.mark.parametrize(("precision", "dtype"), [("fp16", "float16"), ("bf16", "bfloat16")])
def test_mixed_precision_through_the_pipeline(world4, precision, dtype):
    out = world4.run(_mixed_pipeline, precision, preset="tiny-gpt", dp=2, pp=2, accum=4)[0]
    assert out["dtypes"] == {f"torch.{dtype}"}
    torch.testing.assert_close(
        torch.tensor(out["losses"]), torch.tensor(out["ref_losses"]), rtol=2e-2, atol=0
    )
    torch.testing.assert_close(
        torch.tensor(out["norms"]), torch.tensor(out["ref_norms"]), rtol=5e-2, atol=0
    )
    assert out["scale"] == (2.0**16 if precision == "fp16" else 1.0)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"zero": 1, "pp": 2, "schedule": "2bw"}, "schedule 2bw keeps its own two weight"),
    ],
)
def test_zero_pipeline_errors(over, message):
    cfg = build_regrouped(
        "tiny-gpt", {"parallel": over, "train": {"seq_len": 32, "micro_batch": 1}}
    )
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate()
