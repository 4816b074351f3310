"""Activation offload (`--offload-activations cpu`): bitwise the run without it, in every
layout it was asked for, with and without full recomputation; the tracker counts the blocks'
saved tensors on the host and the ends' on the device, as the estimate says; bad input is
one line. One 2-rank world for the module."""

from __future__ import annotations

import pytest
import torch

from memory_runs import Case
from plait.build.model import build_model
from plait.cli import main
from plait.estimate import estimate
from plait.memory_tracker import MemoryTracker
from plait.mesh import build_mesh
from plait.models.dropout import sample_keys
from plait.models.presets import get_preset
from plait.parallel.activation_offload import apply_activation_offload
from plait.parallel.activation_recompute import apply_recompute
from plait.train import Trainer
from reference import corpus_for

STEPS = 3
LAYOUTS = {
    "dp2 zero0": {"dp": 2},
    "dp2 zero2": {"dp": 2, "zero": 2},
    "tp2": {"tp": 2},
    "pp2 1f1b": {"pp": 2, "schedule": "1f1b"},
    "dp2 zero3": {"dp": 2, "zero": 3},
    "pp2 interleaved v2": {"pp": 2, "schedule": "interleaved", "virtual_stages": 2},
    "pp2 zb-h1": {"pp": 2, "schedule": "zb-h1"},
}


def _case(name: str, recompute: str, target: str) -> Case:
    par = LAYOUTS[name] | {"recompute": recompute, "offload_activations": target}
    return Case(f"{name} {recompute} {target}", parallel=par, model={"dropout": 0.1}, accum=2)


def run_steps(case: Case) -> dict:
    """Losses of every step, this rank's parameters after them, and the metered second
    step's device and host activation peaks."""
    cfg = case.config()
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), 60)
    trainer = Trainer(cfg, mesh, corpus_for(cfg))
    tracker = trainer.engine.memory
    losses, peaks = [], {}
    for step in range(STEPS):
        losses.append(trainer.train_step(meter_activations=step == 1).loss)
        if step == 1:
            peaks = {p: tracker.peak("activations", p) for p in ("device", "host")}
    with trainer.engine.unsharded():  # ZeRO-3 holds a shard between steps
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    out = {"pp_rank": mesh.coord.pp, "losses": losses, "params": params, "peaks": peaks}
    trainer.close()
    return out


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bitwise_and_metered_as_estimated(world2, layout, recompute):
    """Losses every step and parameters after them bitwise equal; on each rank the host holds
    what the estimate's host term says, exactly, and the device term is off by no more than
    the run without offload is (tp2's ends carry a gap of their own, ~128 B, before offload:
    dp and pp layouts are exact)."""
    plain_case, case = (_case(layout, recompute, t) for t in ("none", "cpu"))
    plain, moved = world2.run(run_steps, plain_case), world2.run(run_steps, case)
    est, plain_est = estimate(case.config()), estimate(plain_case.config())
    for a, b in zip(plain, moved, strict=True):
        assert a["losses"] == b["losses"]
        assert a["params"].keys() == b["params"].keys()
        for name, p in a["params"].items():
            assert torch.equal(p, b["params"][name]), name
        # the blocks' share moved; nothing is counted twice
        assert 0 < b["peaks"]["host"] < a["peaks"]["device"]
        assert b["peaks"]["device"] < a["peaks"]["device"]
        line = est.ranks[b["pp_rank"]].line("activations")
        before = plain_est.ranks[a["pp_rank"]].line("activations")
        assert line.host == b["peaks"]["host"], (layout, recompute)
        gap, gap_before = line.device - b["peaks"]["device"], before.device - a["peaks"]["device"]
        assert abs(gap) <= abs(gap_before), (layout, recompute, gap, gap_before)
        if layout != "tp2":
            assert gap == 0, (layout, recompute, line, b["peaks"])


def _model(target: str, recompute: str):
    cfg = get_preset("tiny-gpt")
    cfg.dropout = 0.1
    model = build_model(cfg, torch.device("cpu"), seed=3)
    apply_recompute(model, recompute)
    apply_activation_offload(model, target)
    return model


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_single_process_gradients_bitwise(recompute):
    """One process, no world: the same gradients, and the meter sees host bytes only when
    offloading (a plain copy on CPU is still a copy)."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (2, 32), generator=g) for _ in range(2))
    keys = sample_keys(0, 0, torch.arange(2))
    grads, host = {}, {}
    for target in ("none", "cpu"):
        model, tracker = _model(target, recompute), MemoryTracker()
        with tracker.activations():
            model(x, y, keys).backward()
        host[target] = tracker.peak("activations", "host")
        grads[target] = [p.grad for p in model.parameters()]
    assert host["none"] == 0 < host["cpu"]
    assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads["cpu"], strict=True))


def test_unknown_target_is_one_line_exit_2(capsys, monkeypatch):
    """`--offload-activations gpu`: one line and exit 2, before any worker starts."""
    monkeypatch.setenv("COLUMNS", "40")  # a narrow terminal must not wrap the line
    assert main(["train", "--offload-activations", "gpu"]) == 2
    err = capsys.readouterr().err
    assert "offload-activations must be one of none, cpu; got 'gpu'" in err
    assert err.startswith("plait: error: ") and err.count("\n") == 1, err


def run_two_bw(target: str, recompute: str) -> dict:
    """2BW's losses every step and its latest weights after them (its memory is held to the
    estimate in test_estimate_measured.py)."""
    par = {"pp": 2, "schedule": "2bw", "recompute": recompute, "offload_activations": target}
    cfg = Case("2bw", parallel=par, model={"dropout": 0.1}, accum=4).config()
    cfg.train.steps = STEPS  # the 2BW stream is built for the run's steps
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), 60)
    trainer = Trainer(cfg, mesh, corpus_for(cfg))
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.close()
    return {"losses": losses, "params": params}


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_two_bw_bitwise(world2, recompute):
    """PipeDream-2BW: offload wraps both weight versions' copies of the blocks, so the run is
    bitwise 2BW without offload (losses every step, the latest weights)."""
    plain, moved = (world2.run(run_two_bw, t, recompute) for t in ("none", "cpu"))
    for a, b in zip(plain, moved, strict=True):
        assert a["losses"] == b["losses"]
        assert a["params"].keys() == b["params"].keys()
        assert all(torch.equal(p, b["params"][n]) for n, p in a["params"].items())


def test_two_bw_wraps_both_copies():
    """Both weight versions' blocks run under the offload hooks (a forward on either copy
    puts host bytes in the meter), not only the model 2BW was handed."""
    from plait.comm import Comm
    from plait.mesh import single_process_mesh
    from plait.parallel.pipeline.weight_versions import WeightVersions

    cfg = Case("2bw", parallel={"pp": 1}, accum=1).config()
    model = build_model(cfg.model, torch.device("cpu"), seed=3)
    versions = WeightVersions(model, cfg.optim, Comm(single_process_mesh()), "none", "cpu")
    x = torch.randint(0, cfg.model.vocab_size, (1, 8))
    for c in versions.copies:
        tracker = MemoryTracker()
        with tracker.activations():
            c(x, x, sample_keys(0, 0, torch.arange(1))).backward()
        assert tracker.peak("activations", "host") > 0
