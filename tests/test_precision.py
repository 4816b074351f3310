"""Mixed precision: policies, the dynamic loss scaler, and the engine against an emulation.

The emulated reference is the textbook recipe written out per parameter with no plait
machinery: a 16-bit compute model, fp32 master weights with torch's AdamW, gradients
converted to the reduction dtype, divided by dp and all-reduced, unscaled into fp32 master
gradients; the masters rounded back into the compute model after each step. Every ZeRO
stage, trained by the production step (`Trainer.train_step`), must reproduce it bit for bit
(no clipping: its norm is summed in another order).
"""

from __future__ import annotations

import pytest
import torch

from plait.build.model import build_model
from plait.comm import Comm
from plait.data import GlobalBatchSampler, replica_share
from plait.errors import ConfigError
from plait.mesh import build_mesh
from plait.mixed_precision import DynamicLossScaler, LossScaleError, has_inf_or_nan, parse_precision
from plait.models.dropout import sample_keys
from plait.optim import build_optimizer, lr_at, set_lr
from plait.parallel.zero.engine import ZeroEngine
from reference import corpus_for
from zero_helpers import after_finish, record, zero_config, zero_trainer

# ---------------------------------------------------------------- pure


def test_policies():
    assert parse_precision("fp32").reduce_dtype == torch.float32
    bf16 = parse_precision("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    assert bf16.needs_master and not bf16.needs_scaler
    assert parse_precision("bf16", "fp32").reduce_dtype == torch.float32
    assert parse_precision("fp16").needs_scaler
    assert not parse_precision("fp32").needs_master


def test_policy_errors_name_the_values():
    with pytest.raises(ConfigError, match="precision must be one of fp32, bf16, fp16; got 'fp8'"):
        parse_precision("fp8")
    with pytest.raises(ConfigError, match="for precision bf16 must be bf16 or fp32; got 'fp16'"):
        parse_precision("bf16", "fp16")


def test_scaler_backs_off_skips_and_grows_after_window():
    s = DynamicLossScaler(scale=1024.0, window=3)
    assert s.update(found_inf=True) and s.scale == 512.0 and s.skipped_steps == 1
    assert not s.update(False) and not s.update(False) and s.scale == 512.0
    assert not s.update(False) and s.scale == 1024.0  # third clean step in a row
    s.update(False)
    s.update(True)  # an overflow restarts the window
    assert s.scale == 512.0 and s.clean_steps == 0
    state = s.state_dict()
    t = DynamicLossScaler()
    t.load_state_dict(state)
    assert t.scale == 512.0 and t.skipped_steps == 2


def test_scaler_error_at_minimum_scale():
    s = DynamicLossScaler(scale=4.0, min_scale=2.0)
    assert s.update(True) and s.scale == 2.0
    with pytest.raises(LossScaleError, match="inf/nan even at the minimum loss scale 2"):
        s.update(True)


def test_scaler_config_errors():
    with pytest.raises(ConfigError, match="growth_factor > 1"):
        DynamicLossScaler(growth_factor=1.0)
    with pytest.raises(ConfigError, match=r"min_scale 8\.0, scale 4\.0"):
        DynamicLossScaler(scale=4.0, min_scale=8.0)


# ---------------------------------------------------------------- emulated reference


def _emulate(cfg, corpus, precision: str, reduce: str | None, scaler: DynamicLossScaler | None):
    """The recipe per parameter (module docstring); returns losses, scales, master params."""
    policy = parse_precision(precision, reduce)
    t = cfg.train
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), 60)
    comm, dp = Comm(mesh), mesh.size("dp")
    master = build_model(cfg.model, mesh.device, t.seed)
    opt = build_optimizer(master, cfg.optim)
    compute = build_model(cfg.model, mesh.device, t.seed).to(policy.param_dtype)
    pairs = list(zip(compute.parameters(), master.parameters(), strict=True))
    sampler = GlobalBatchSampler(len(corpus.train), t.global_batch, t.seed)
    losses, scales = [], []
    for step in range(t.steps):
        share, positions = replica_share(sampler.next_batch(), mesh.coord.dp, dp)
        x, y = corpus.train.batch(share)
        scale = scaler.scale if scaler else 1.0
        loss = compute(x, y, sample_keys(t.seed, step, positions))
        (loss * scale).backward()
        for pc, pm in pairs:
            g = pc.grad.to(policy.reduce_dtype).div_(dp)
            comm.all_reduce(g, "dp")
            pm.grad, pc.grad = g.float() * (1.0 / scale), None
        found = any(not bool(torch.isfinite(pm.grad).all()) for _, pm in pairs)
        scales.append(scale)
        if not (scaler and scaler.update(found)):
            set_lr(opt, lr_at(step, cfg.optim, t.steps))
            opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pc, pm in pairs:
                pc.copy_(pm)
        comm.all_reduce(loss := loss.detach().float(), "dp", op="avg")
        losses.append(float(loss))
    return losses, scales, {n: p.detach().clone() for n, p in master.named_parameters()}


def _start_scaler(scaler: DynamicLossScaler, scale: float, window: int) -> None:
    """Give the engine's fp16 scaler, before its first step, a start that moves within a
    few steps (the default's window is 2000 steps)."""
    scaler.scale, scaler.window = scale, window


def _against_emulation(precision: str, reduce: str | None, stages: list[int]) -> dict:
    cfg = zero_config(steps=6)
    cfg.optim.grad_clip = 0.0
    corpus = corpus_for(cfg)
    fp16 = precision == "fp16"
    ref_scaler = DynamicLossScaler(scale=2.0**14, window=3) if fp16 else None
    losses, scales, masters = _emulate(cfg, corpus, precision, reduce, ref_scaler)
    dtypes = {}
    for stage in stages:
        trainer = zero_trainer(cfg, corpus, stage, precision=precision, reduce=reduce)
        engine: ZeroEngine = trainer.engine
        if fp16:
            _start_scaler(engine.scaler, 2.0**14, 3)
        got = record(trainer)
        assert got.losses == losses, stage
        full = {}
        for piece in engine.state_dict()["pieces"]:
            full.setdefault(piece.name, []).append(piece)
        for name, pieces in full.items():
            flat = masters[name].reshape(-1)
            for p in pieces:
                assert torch.equal(p.tensors["master"], flat[p.start : p.start + p.length]), name
        for name, value in got.params.items():  # compute copies = rounded masters
            assert torch.equal(value, masters[name].to(engine.precision.param_dtype).float())
        if fp16:
            assert engine.scaler.state_dict() == ref_scaler.state_dict()
        dtypes[stage] = sorted(
            {
                (row["op"], row["tag"], row["dtype"])
                for row in got.stats[-1]
                if row["tag"] in ("grad", "params")
            }
        )
        trainer.close()
    return {"dtypes": dtypes, "scales": scales}


@pytest.mark.parametrize(
    "precision,reduce,dtype",
    [("bf16", None, "bfloat16"), ("bf16", "fp32", "float32"), ("fp16", None, "float16")],
)
def test_engine_equals_emulated_mixed_precision(world2, precision, reduce, dtype):
    r = world2.run(_against_emulation, precision, reduce, [0, 1, 2, 3])[0]
    param = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    assert r["dtypes"][0] == [("all_reduce", "grad", dtype)]
    for stage in (1, 2, 3):  # gradients in the reduction dtype, parameters in compute dtype
        assert r["dtypes"][stage] == [
            ("all_gather", "params", param),
            ("reduce_scatter", "grad", dtype),
        ]
    if precision == "fp16":
        assert len(set(r["scales"])) > 1  # the scale moved (overflow back-off or growth)


# ---------------------------------------------------------------- overflow on one rank


def _overflow(stage: int) -> dict:
    """fp16 steps of the Trainer; at the steps asked, rank 1 plants an inf in its own
    gradient shard once the step's reduction has finished."""
    cfg = zero_config()
    cfg.optim.grad_clip = 1.0
    trainer = zero_trainer(cfg, corpus_for(cfg), stage, precision="fp16")
    engine, rank = trainer.engine, trainer.mesh.rank
    scaler = engine.scaler
    _start_scaler(scaler, 256.0, 2)
    out: dict = {}

    def plant(inject: bool) -> None:
        if inject and rank == 1:
            engine.grad_shards()[-1][0] = float("inf")  # this rank's shard only
        out["local_inf"] = bool(has_inf_or_nan(engine.grad_shards(), trainer.mesh.device))

    def step(inject: bool) -> bool:
        with after_finish(engine, lambda: plant(inject)):
            trainer.train_step()
        return not engine.last_step_skipped

    def snapshot():
        with engine.unsharded():
            params = [p.detach().clone() for p in trainer.model.parameters()]
        return params, engine.state_dict()["pieces"]

    out.update(first=step(False), scale_before=scaler.scale)
    params, states = snapshot()
    out["skipped"] = not step(True)
    out["saw_inf"] = out["local_inf"]
    out["scale_after"], out["steps"] = scaler.scale, engine.step_count
    params2, states2 = snapshot()
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(params, params2, strict=True)) and all(
        torch.equal(a.tensors[k], b.tensors[k])
        for a, b in zip(states, states2, strict=True)
        for k in a.tensors
    )
    out["grown"] = [step(False), step(False), scaler.scale]  # window of 2 clean steps
    scaler.min_scale = scaler.scale
    with pytest.raises(LossScaleError) as info:
        step(True)
    out["error"] = str(info.value)
    trainer.close()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_inf_on_one_rank_skips_everywhere_then_scale_grows(world2, stage):
    results = world2.run(_overflow, stage)
    assert [r["saw_inf"] for r in results] == [False, True]  # only rank 1 saw it...
    for r in results:  # ...and both ranks skipped: the flag was all-reduced
        assert r["first"] and r["skipped"] and r["unchanged"]
        assert (r["scale_before"], r["scale_after"], r["steps"]) == (256.0, 128.0, 1)
        assert r["grown"] == [True, True, 256.0]
        assert "inf/nan even at the minimum loss scale 256" in r["error"]
