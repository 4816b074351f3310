"""The context-parallel parity run (no tests here): a layout with --cp trained on packed,
masked rows against one process (tests/reference.py)."""

from __future__ import annotations

import torch

from packed_rows import packed_corpus
from plait.mesh import build_mesh
from plait.train import Trainer
from reference import assert_matches_reference, small_config
from whole_params import whole_params

CP_TAGS = ("cp_kv", "cp_kv_grad", "cp_ring_kv", "cp_ring_back", "cp_ring_home")
"""What the exchange's calls are tagged with in the comm layer's counts."""
PARAM_ATOL = 5e-5  # as exact_loss.py: Adam turns rounding-order differences into ~1e-6


def cp_parity(
    cp: int = 2, exchange: str = "allgather", steps: int = 10, zero: int = 0,
    sequence_parallel: bool = False, lora: int = 0, **kw,
) -> dict:  # fmt: skip
    """Train `kw` (small_config's layout) with `cp` on packed rows whose documents straddle
    the cut; loss and gradient norm every step, the parameters after `steps` and the
    validation loss must equal one process's. Returns the losses and the comm layer's cp
    traffic of the last step."""
    cfg = small_config(steps=steps, **kw)
    par = cfg.parallel
    par.cp, par.cp_exchange, par.zero = cp, exchange, zero
    par.sequence_parallel = sequence_parallel
    if lora:
        cfg.model.lora_rank, cfg.model.lora_targets = lora, "all"
    cfg.validate(check_data=False)
    corpus = packed_corpus(cfg)
    mesh = build_mesh(par.layout, torch.device("cpu"), par.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus)
    results = [trainer.train_step() for _ in range(steps)]
    stats = trainer.comm.stats
    traffic = {  # what this rank sent or gathered: the ring's receives left out
        tag: stats.total(tag=tag, axis="cp")[1] - stats.total("recv", tag, "cp")[1]
        for tag in CP_TAGS
    }
    val = trainer.evaluate()
    params = whole_params(trainer)
    trainer.close()
    assert_matches_reference(cfg, corpus, results, params, val, PARAM_ATOL)
    return {"losses": [r.loss for r in results], "traffic": traffic}
