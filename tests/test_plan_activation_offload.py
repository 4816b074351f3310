"""`plait plan` and activation offload: the copies' time at the host link (the copy down
hidden behind the forward up to the profile's overlap, the copy back exposed), offered only
where nothing else fits on the device, never on a profile whose host is the device, and
bounded by a profile's host memory per node. Pure: no process starts."""

from __future__ import annotations

import dataclasses

import pytest

from plait.estimate import estimate
from plait.estimate.core import chunk_activation_places
from plait.models.presets import get_preset
from plait.plan.enumerate import Request, knobs, shapes
from plait.plan.hardware import Hardware, Link, OpCost, from_dict, to_dict
from plait.plan.search import config_of, plan
from plait.plan.step_time import Memo, step_time
from plait.schedule.stages import rank_plans
from sections import build_regrouped

GIB = 2**30


def _hw(overlap: float = 0.0, **kw) -> Hardware:
    link = Link({"all_reduce": OpCost(0.0, 1e9)})
    base = dict(name="test", peak_flops=1e12, achievable=0.5, memory=80 * GIB,
                host_bandwidth=1e9, disk_bandwidth=1e9, intra=link, inter=link,
                precision="fp32", overlap=overlap)  # fmt: skip
    return Hardware(**{**base, **kw})


def _cfg(**par):
    over = {"parallel": par, "train": {"seq_len": 32, "global_batch": 8, "micro_batch": 2}}
    cfg = build_regrouped("tiny-gpt", over)
    cfg.validate()
    return cfg


@pytest.mark.parametrize("bandwidth", [1e9, 1e12])
@pytest.mark.parametrize("overlap", [0.0, 1.0])
def test_copies_at_the_host_link(overlap, bandwidth):
    """One process, 4 micro-batches: each moves the estimator's host bytes down and back at
    the host link; up to `overlap` of the copy down hides behind the micro-batch's forward
    (at 1 TB/s all of it, at 1 GB/s the forward's length of it), the copy back never."""
    hw = _hw(overlap, host_bandwidth=bandwidth)
    plain, moved = (step_time(_cfg(offload_activations=t), hw, 8, Memo()) for t in ("none", "cpu"))
    cfg = _cfg(offload_activations="cpu")
    nbytes = chunk_activation_places(cfg, rank_plans(cfg.model.n_layers, 1, 1, 0)[0])[1]
    assert nbytes > 0
    forward = plain.compute / 3 / 4  # F's compute of one micro-batch (B = W = F)
    copy = nbytes / bandwidth
    assert (copy < forward) == (bandwidth == 1e12)
    down = copy - overlap * min(copy, forward)
    assert moved.offload == pytest.approx(4 * (down + copy))
    assert moved.total == pytest.approx(plain.total + moved.offload)
    assert (moved.compute, moved.bubble) == (plain.compute, pytest.approx(plain.bubble))


def _req() -> Request:
    return Request(get_preset("tiny-gpt"), "tiny-gpt", 1, 1, 8, 32, "fp32", 4)


def _needs(req: Request, hw: Hardware, act: str) -> int:
    """The least device memory any setting with (or without) activation offload needs."""
    return min(
        estimate(config_of(req, c)).most_loaded.total()
        for s in shapes(req)
        for c in knobs(req, s)
        if c.offload_activations == act
    )


def test_offloaded_where_nothing_else_fits():
    """A device one byte short of every setting that keeps its activations: the plan ranks
    only settings that offload them; with room for them, none does (it costs time)."""
    req, hw = _req(), _hw()
    budget = _needs(req, hw, "none") - 1
    assert _needs(req, hw, "cpu") <= budget
    tight = plan(req, hw, budget, top=3)
    assert tight.ranked and all(r.candidate.offload_activations == "cpu" for r in tight.ranked)
    assert all(r.memory <= budget for r in tight.ranked)
    assert "activations cpu" in tight.ranked[0].candidate.describe()
    roomy = plan(req, hw, 80 * GIB, top=3)
    assert all(r.candidate.offload_activations == "none" for r in roomy.ranked)
    # a CPU profile's host is its device: offloading frees nothing there, so it is not offered
    assert not plan(req, _hw(host_is_device=True), budget, top=3).ranked


def test_host_memory_per_node_bounds_it():
    """A profile with less host memory per node than the offloaded bytes: dropped, naming
    the host's bytes."""
    req = _req()
    budget = _needs(req, _hw(), "none") - 1
    out = plan(req, _hw(host_memory=1024), budget, top=3)
    assert not out.ranked
    host = [d for d in out.dropped if d.largest == "host per node"]
    assert host and all(d.largest_bytes > 1024 for d in host)


def test_profile_round_trip_keeps_the_host_fields():
    hw = _hw(host_memory=2 * 10**12, host_is_device=True)
    assert from_dict(to_dict(hw)) == hw
    assert from_dict(to_dict(_hw())) == _hw()
    assert dataclasses.replace(hw, host_memory=0).host_memory == 0
