"""Naive data parallelism (one coordinator) reproduces single-process training, and moves
and holds what the lesson says: the logits twice per micro-batch, the parameters and the
gradients once per step, the optimizer states on rank 0 alone."""

from __future__ import annotations

import pytest
import torch

from plait.config import Config
from plait.errors import ConfigError
from plait.mesh import build_mesh
from plait.models.transformer import count_parameters
from plait.train import Trainer
from reference import corpus_for, reference_run, small_config

RTOL, PARAM_ATOL = 1e-5, 1e-5  # as test_dp_parity.py


def _naive(**kw) -> Config:
    cfg = small_config(**kw)
    cfg.parallel.dp_mode = "naive"
    cfg.validate()
    return cfg


def _parity(**kw) -> dict:
    cfg = _naive(**kw)
    corpus = corpus_for(cfg)
    trainer = Trainer(cfg, build_mesh(cfg.parallel.layout, torch.device("cpu"), 60), corpus)
    steps = [trainer.train_step() for _ in range(cfg.train.steps)]
    params = [p.detach().clone() for p in trainer.model.parameters()]
    ref_losses, ref_norms, ref_params = reference_run(cfg, corpus)
    torch.testing.assert_close(torch.tensor([r.loss for r in steps]), torch.tensor(ref_losses),
                               rtol=RTOL, atol=0)  # fmt: skip
    torch.testing.assert_close(torch.tensor([r.grad_norm for r in steps]),
                               torch.tensor(ref_norms), rtol=RTOL, atol=0)  # fmt: skip
    for p, r in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, r, rtol=RTOL, atol=PARAM_ATOL)
    out = {
        "bytes": trainer.comm.stats.bytes_by_op(),
        "states": trainer.engine.memory.current("optimizer_states"),
        "buffers": trainer.engine.memory.peak("comm_buffers"),
    }
    trainer.close()
    return out


@pytest.mark.parametrize(
    "case",
    [dict(preset="tiny-gpt", accum=2), dict(preset="tiny-llama", accum=1, dropout=0.1,
                                           recompute="full")],
    ids=["gpt-accum2", "llama-dropout-recompute"],
)  # fmt: skip
def test_naive_matches_single_process_and_moves_what_the_lesson_says(world2, case):
    out = world2.run(_parity, dp=2, steps=4, **case)
    cfg = _naive(dp=2, steps=4, **case)
    psi, t, v = count_parameters(cfg.model), cfg.train, cfg.model.vocab_size
    n, whole = cfg.accumulation, t.micro_batch * 2  # micro-batches, rows of each
    assert (
        out[0]["bytes"]
        == out[1]["bytes"]
        == {
            "broadcast": 4 * psi + 8 + 4,  # parameters, the grad norm (fp64), the loss
            "scatter": n * (whole * t.seq_len * 8 + whole * 8 + whole * t.seq_len * v * 4),
            "gather": n * whole * t.seq_len * v * 4,  # the logits to rank 0
            "reduce": 4 * psi,  # the gradients to rank 0
            "all_reduce": 4,  # the step's loss, as every layout reports it
        }
    )
    assert out[0]["states"] == 2 * 4 * psi and out[1]["states"] == 0  # Adam's moments
    assert out[0]["buffers"] == 2 * whole * t.seq_len * v * 4 and out[1]["buffers"] == 0


def test_naive_is_refused_with_other_parallelism():
    with pytest.raises(ConfigError, match="dp_mode naive is plain data parallelism"):
        _naive(dp=1, tp=2)
    cfg = small_config()
    cfg.parallel.dp_mode = "torch"
    with pytest.raises(ConfigError, match="dp_mode must be one of ddp, naive; got 'torch'"):
        cfg.validate()
