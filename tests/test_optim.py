"""Tests for plait.optim: parameter groups and the warmup + cosine schedule.

Clipping and the global norm are tested in test_grads.py."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from plait.config import OptimConfig
from plait.optim import build_optimizer, lr_at, set_lr
from reference import Tiny

# --- schedule -----------------------------------------------------------------------------


@dataclass
class Sched(OptimConfig):
    """[optim]'s schedule and the run's length ([train] steps), which it decays over."""

    steps: int = 100


def sched(**kw: float) -> Sched:
    base = {"steps": 100, "warmup_steps": 10, "lr": 1e-3, "min_lr": 1e-4}
    return Sched(**{**base, **kw})


def test_warmup_is_linear_and_reaches_lr() -> None:
    cfg = sched()
    warm = [lr_at(s, cfg, cfg.steps) for s in range(cfg.warmup_steps)]
    assert warm == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])
    steps = [b - a for a, b in itertools.pairwise(warm)]
    assert steps == pytest.approx([1e-4] * 9)  # constant increments: linear
    assert warm[0] > 0  # the first step already learns
    assert lr_at(cfg.warmup_steps - 1, cfg, cfg.steps) == pytest.approx(cfg.lr)
    assert lr_at(cfg.warmup_steps, cfg, cfg.steps) == pytest.approx(
        cfg.lr
    )  # cosine starts at the peak


def test_peak_is_lr_and_end_is_min_lr() -> None:
    cfg = sched()
    lrs = [lr_at(s, cfg, cfg.steps) for s in range(cfg.steps + 1)]
    assert max(lrs) == pytest.approx(cfg.lr)
    assert lr_at(cfg.steps, cfg, cfg.steps) == pytest.approx(cfg.min_lr)
    assert lr_at(cfg.steps + 50, cfg, cfg.steps) == pytest.approx(cfg.min_lr)  # stays there
    assert min(lrs) >= cfg.min_lr - 1e-15
    # Halfway through the decay, cosine is at the midpoint of lr and min_lr.
    mid = cfg.warmup_steps + (cfg.steps - cfg.warmup_steps) // 2
    assert lr_at(mid, cfg, cfg.steps) == pytest.approx((cfg.lr + cfg.min_lr) / 2)


def test_monotone_decay_after_warmup() -> None:
    cfg = sched()
    decay = [lr_at(s, cfg, cfg.steps) for s in range(cfg.warmup_steps, cfg.steps + 1)]
    assert all(b < a for a, b in itertools.pairwise(decay))


def test_cosine_shape() -> None:
    cfg = sched(steps=110, warmup_steps=10)
    for s in (10, 35, 60, 85, 110):
        progress = (s - 10) / 100
        expected = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * progress))
        assert lr_at(s, cfg, cfg.steps) == pytest.approx(expected)


def test_no_warmup_starts_at_peak() -> None:
    cfg = sched(warmup_steps=0)
    assert lr_at(0, cfg, cfg.steps) == pytest.approx(cfg.lr)
    assert lr_at(cfg.steps, cfg, cfg.steps) == pytest.approx(cfg.min_lr)


def test_warmup_longer_than_the_run_does_not_divide_by_zero() -> None:
    cfg = sched(steps=5, warmup_steps=10)
    assert [lr_at(s, cfg, cfg.steps) for s in range(5)] == pytest.approx(
        [1e-4, 2e-4, 3e-4, 4e-4, 5e-4]
    )
    cfg = sched(steps=10, warmup_steps=10)
    assert lr_at(10, cfg, cfg.steps) == pytest.approx(cfg.lr)  # span clamps to 1: progress 0


# --- parameter groups ---------------------------------------------------------------------


def ids(group: dict) -> set[int]:
    return {id(p) for p in group["params"]}


def test_build_optimizer_groups() -> None:
    model = Tiny()
    cfg = OptimConfig(lr=2e-3, weight_decay=0.25, beta1=0.8, beta2=0.9)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert ids(decay) == {id(model.emb.weight), id(model.proj.weight)}
    assert ids(no_decay) == {id(model.norm.weight), id(model.norm.bias), id(model.proj.bias)}
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    assert decay["weight_decay"] == 0.25 and no_decay["weight_decay"] == 0.0
    for g in (decay, no_decay):
        assert g["lr"] == 2e-3 and g["betas"] == (0.8, 0.9)
    # The frozen weight is in neither group.
    assert id(model.frozen.weight) not in ids(decay) | ids(no_decay)


def test_tied_parameter_appears_once() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    model[1].weight = model[0].weight
    opt = build_optimizer(model, OptimConfig())
    decay, no_decay = opt.param_groups
    assert len(decay["params"]) == 1 and len(no_decay["params"]) == 1


def test_weight_decay_applies_only_to_matrices() -> None:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    opt = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.5))
    model.weight.grad = torch.zeros_like(model.weight)
    model.bias.grad = torch.zeros_like(model.bias)
    opt.step()
    # Zero gradient: only decoupled weight decay moves a parameter (p *= 1 - lr * wd).
    assert torch.allclose(model.weight, torch.full_like(model.weight, 0.95))
    assert torch.equal(model.bias, torch.ones_like(model.bias))


def test_set_lr_sets_every_group() -> None:
    opt = build_optimizer(Tiny(), OptimConfig())
    set_lr(opt, 0.123)
    assert [g["lr"] for g in opt.param_groups] == [0.123, 0.123]


# --- the schedules against transformers' ---------------------------------------------------


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [0, 7])
def test_schedules_are_transformers_with_warmup_one_step_ahead(kind: str, warmup: int) -> None:
    """transformers' get_{kind}_schedule_with_warmup for the same step counts (a test
    reference only): with min_lr 0 (theirs decays to 0) every step after the warmup is
    theirs exactly, and warmup step k is their step k + 1 (plait's first step learns)."""
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    steps, lr = 60, 1e-3
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    if kind == "constant":
        ref = get_constant_schedule_with_warmup(opt, warmup)
    else:
        make = (
            get_cosine_schedule_with_warmup if kind == "cosine" else get_linear_schedule_with_warmup
        )
        ref = make(opt, warmup, steps)
    factor = ref.lr_lambdas[0]
    theirs = [lr * factor(k) for k in range(steps + 2)]
    cfg = sched(steps=steps, warmup_steps=warmup, lr=lr, min_lr=0.0, lr_schedule=kind)
    ours = [lr_at(k, cfg, cfg.steps) for k in range(steps + 1)]
    expected = [theirs[k + 1] if k < warmup else theirs[k] for k in range(steps + 1)]
    assert ours == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_linear_and_constant_with_a_floor() -> None:
    """min_lr is where linear ends (as cosine's); constant holds lr after the warmup."""
    cfg = sched(lr_schedule="linear")  # warmup 10 of 100 steps, lr 1e-3 down to 1e-4
    assert lr_at(55, cfg, cfg.steps) == pytest.approx(1e-4 + (1e-3 - 1e-4) * (1 - 45 / 90))
    assert lr_at(100, cfg, cfg.steps) == pytest.approx(1e-4) == lr_at(500, cfg, cfg.steps)
    decay = [lr_at(s, cfg, cfg.steps) for s in range(10, 101)]
    steps = [a - b for a, b in itertools.pairwise(decay)]
    assert steps == pytest.approx([(1e-3 - 1e-4) / 90] * 90)  # a straight line
    cfg = sched(lr_schedule="constant")
    assert [lr_at(s, cfg, cfg.steps) for s in (0, 9, 10, 99, 400)] == pytest.approx(
        [1e-4, 1e-3, 1e-3, 1e-3, 1e-3]
    )
