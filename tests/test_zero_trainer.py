"""ZeRO through the Trainer and the command line reproduces single-process training (fp32)."""

from __future__ import annotations

import pytest
import torch

from plait.errors import ConfigError
from plait.mesh import build_mesh
from plait.train import Trainer
from reference import assert_matches_reference, corpus_for, small_config
from sections import build_regrouped

RTOL, PARAM_ATOL = 1e-5, 5e-5  # see test_pp_parity.py


def _zero_parity(zero: int, offload: str = "none", offload_dir=None, **kw) -> dict:
    cfg = small_config(**kw)
    cfg.memory.zero, cfg.memory.offload, cfg.memory.offload_dir = zero, offload, offload_dir
    cfg.validate()
    corpus = corpus_for(cfg)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), 60)
    trainer = Trainer(cfg, mesh, corpus)
    results = [trainer.train_step() for _ in range(cfg.train.steps)]
    val = trainer.evaluate()
    with trainer.engine.unsharded():
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    state_bytes = trainer.engine.memory.model_state_bytes()
    trainer.close()
    assert_matches_reference(cfg, corpus, results, params, val, PARAM_ATOL)
    return {"state_bytes": state_bytes}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_stages_through_the_trainer_match_single_process(world2, zero):
    world2.run(_zero_parity, zero=zero, dp=2, accum=2, preset="tiny-gpt")


def test_zero_offload_through_the_trainer(world2, tmp_path):
    world2.run(_zero_parity, zero=2, offload="cpu", dp=2, preset="tiny-llama")
    world2.run(_zero_parity, zero=1, offload="nvme", offload_dir=str(tmp_path), dp=2)


def _bf16_trains(**kw) -> list[float]:
    cfg = small_config(steps=30, **kw)
    cfg.train.precision, cfg.memory.zero = "bf16", 2
    cfg.optim.lr = 3e-3
    cfg.validate()
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), 60)
    trainer = Trainer(cfg, mesh, corpus_for(cfg))
    losses = [trainer.train_step().loss for _ in range(cfg.train.steps)]
    trainer.close()
    return losses


def test_bf16_zero2_loss_falls(world2):
    losses = world2.run(_bf16_trains, dp=2, micro=4, preset="tiny-gpt")[0]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"zero": 4}, r"memory.zero must be in \[0, 3\], got 4"),
        ({"precision": "fp8"}, "precision must be one of"),
        ({"offload": "nvme"}, "needs a directory"),
    ],
)
def test_zero_option_errors(over, message):
    cfg = build_regrouped("tiny-gpt", {"parallel": over, "train": {"seq_len": 32}})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate()


def _stage3_never_materializes(**kw) -> None:
    from plait.build.model import build_model
    from plait.comm import Comm
    from plait.models.init import initial_values
    from plait.parallel.adamw import AdamW
    from plait.parallel.zero.engine import ZeroEngine
    from plait.parallel.zero.options import ZeroOptions

    cfg = small_config(**kw)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), 60)
    comm, seed = Comm(mesh), cfg.train.seed
    model = build_model(cfg.model, mesh.device, seed, materialize=False)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    value, held = initial_values(model, seed, cfg.model), []

    asked = []  # elements requested: the shard's rows only, never a whole parameter

    def spy(p: torch.nn.Parameter, rows=None) -> torch.Tensor:  # bytes the model holds now
        held.append(sum(q.untyped_storage().nbytes() for q in model.parameters()))
        asked.append(value(p, rows).numel())
        return value(p, rows)

    adamw = AdamW.from_optim(cfg.optim)
    engine = ZeroEngine(model, comm, adamw, ZeroOptions(stage=3, initial_value=spy))
    assert held and max(held) == 0
    total = sum(p.numel() for p in model.parameters())
    assert sum(asked) < 0.6 * total  # half of it, plus rows that straddle the shard edges
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    ref = ZeroEngine(build_model(cfg.model, mesh.device, seed), comm, adamw, ZeroOptions(stage=3))
    for mine, theirs in zip(engine.params.shards, ref.params.shards, strict=True):
        assert torch.equal(mine, theirs)
    engine.close()
    ref.close()


def test_stage3_fills_shards_without_materializing_the_model(world2):
    world2.run(_stage3_never_materializes, dp=2, preset="tiny-llama")
