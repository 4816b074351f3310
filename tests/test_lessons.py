"""`plait lessons`: each lesson's cases run (quick, 2 steps) on a 2-rank world, once per
module, and the deterministic figures its section reports equal the formulas (bytes per op,
model states, simulated bubbles, tp collectives per phase, saved activations); torch DDP
trains like plait DP; the phase meter attributes collectives to forward, backward and step;
bad requests exit 2 before anything runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from plait.cli import main
from plait.comm import CommStats
from plait.config import Config
from plait.estimate import estimate
from plait.lessons import recompute
from plait.lessons.phases import PhaseMeter
from plait.lessons.runner import choose_procs, plan_cases, registry
from plait.lessons.section import CaseRun, Section, Target
from plait.mesh import build_mesh


def _target(target: Target, cfg: Config) -> dict:
    return target(cfg, build_mesh(cfg.parallel.layout, torch.device("cpu"), 60))


def _runs(world, lesson, out: Path) -> dict[str, CaseRun]:
    runs = {}
    for case in plan_cases(lesson, quick=True, procs=2, work=out / "work"):
        train = dataclasses.replace(case.cfg.train, steps=2)
        log = dataclasses.replace(case.cfg.log, out=str(out / case.label))
        cfg = dataclasses.replace(case.cfg, train=train, log=log)
        runs[case.label] = CaseRun(cfg, world.run(_target, case.target, cfg))
    return runs


@pytest.fixture(scope="module")
def sections(world2, tmp_path_factory) -> Callable[[str], Section]:
    """Each lesson's section, its cases run once per module on the 2-rank world."""
    done: dict[str, Section] = {}

    def get(name: str) -> Section:
        if name not in done:
            lesson, tmp = registry()[name], tmp_path_factory.mktemp(name)
            done[name] = lesson.section(_runs(world2, lesson, tmp / "runs"), tmp / "out")
        return done[name]

    return get


@pytest.mark.parametrize(
    "name",
    [
        "dp",
        "pipeline",
        "tp",
        "zero",
        "precision",
        "recompute",
        "offload",
        "offload-activations",
        "partition-activations",
        "finetune",
        "lora",
        "qlora",
        "light-loss",
        "context-parallel",
    ],
)
def test_each_lesson_reports_the_formulas_exactly(sections, name):
    section = sections(name)
    exact = [r for r in section.rows if r.exact]
    assert len(exact) >= 3
    for row in exact:
        assert row.measured == row.expected, row  # bytes, model states, simulated bubbles
    assert all(f.exists() and f.stat().st_size > 0 for f in section.figures)
    timed = [r for r in section.rows if not r.exact]
    assert timed and all(r.measured > 0 for r in timed)


def test_rank_zero_holds_what_naive_dp_adds(sections):
    rows = {r.what: r for r in sections("dp").rows}
    assert rows["naive: optimizer states on rank 0"].measured > 0
    assert rows["naive: optimizer states on rank 1"].measured == 0


def test_torch_ddp_peer_trains_like_plait_dp(sections):
    section = sections("dp")
    rows = {r.what: r for r in section.rows}
    plait, peer = section.raw["losses"]["ddp"], section.raw["losses"]["torch-ddp"]
    assert len(peer) == 2 and peer[0] == plait[0]
    torch.testing.assert_close(peer, plait, rtol=1e-5, atol=0)
    assert sum(section.raw["ddp_buckets"]) == 4 * section.raw["psi"] > 0
    assert rows["step time plait DP / torch DDP"].measured > 0


def test_tp_counts_four_all_reduces_per_layer_and_none_under_sp(sections):
    section = sections("tp")
    rows = {r.what: r.measured for r in section.rows}
    assert rows["forward: all-reduces per layer"] == 2
    assert rows["backward: all-reduces per layer"] == 2
    assert rows["SP: all-reduces of activations (forward + backward)"] == 0
    assert rows["SP forward: all-gathers per layer"] == rows["SP backward: all-gathers per layer"]
    plain = section.raw["tp"]["phases"]
    assert (
        "all_reduce tp-embed" in plain["forward"] and "all_reduce tp-embed" not in plain["backward"]
    )
    assert (
        "all_reduce tp-head" in plain["backward"] and "all_reduce tp-head" not in plain["forward"]
    )
    split = section.raw["split"]
    assert split["column"]["forward"] == [] and split["row"]["backward"] == []


def test_recompute_trades_activations_for_time(sections):
    raw = sections("recompute").raw
    got, est = raw["measured"], raw["estimate"]
    assert got["full"] < got["selective"] < got["none"]
    cfg = recompute.cases(quick=True, procs=2)[0].cfg
    assert got["none"] == est["none"]  # the tolerance the lesson states for the other two:
    for mode in ("selective", "full"):  # the dropout keys torch's checkpoint saves
        assert got[mode] - est[mode] == recompute.keys_bytes(cfg) > 0, mode


def test_recompute_formula_is_the_estimators():
    """The fp32 per-layer formula the lesson states, against the estimator (the ends, the
    same in every mode, cancel in the differences)."""
    cfgs = {c.label: c.cfg for c in recompute.cases(quick=True, procs=2)}
    held = {m: estimate(c).ranks[0].line("activations").device for m, c in cfgs.items()}
    layers = cfgs["none"].model.n_layers
    for mode in ("none", "selective"):
        formula = recompute.layer_formula(cfgs[mode], mode) - recompute.layer_formula(
            cfgs["full"], "full"
        )
        assert held[mode] - held["full"] == layers * formula, mode


def test_pipeline_stages_hold_what_their_schedule_keeps_in_flight(sections):
    raw = sections("pipeline").raw
    got, est = raw["activations"]["measured"], raw["activations"]["estimate"]
    p, m = len(got["naive"]), 4
    one = got["naive"]  # naive holds one micro-batch
    assert got["gpipe"] == [m * x for x in one]
    assert got["1f1b"][0] == min(p, m) * one[0] and got["1f1b"][-1] == one[-1]
    for name in ("naive", "gpipe", "1f1b", "interleaved"):
        assert got[name] == est[name], name
    zb = [g / e for g, e in zip(got["zb-h1"], est["zb-h1"], strict=True)]
    assert zb[0] == 1 and all(0.85 < r <= 1 for r in zb), zb  # W frees the rest (see notes)


def test_finetune_loss_rules_differ_and_packing_keeps_the_loss(sections):
    """The two loss rules' step-0 gap (same weights) is the one a single process computes,
    and nonzero; packed and padded rows give the same validation loss on the same weights,
    with less padding."""
    section = sections("finetune")
    gap = section.rows[0]
    assert gap.measured > 0 and abs(gap.ratio - 1) < 0.1, gap  # fp32 rounding of ~1e-4
    assert abs(section.rows[1].ratio - 1) < 1e-3, section.rows[1]  # gradient norms' ratio
    for row in section.rows[2:4]:  # each run's reported loss is its rule, recomputed
        assert abs(row.ratio - 1) < 1e-5, row
    packing = section.raw["packing"]
    val = packing["packed"]["val_at_start"], packing["padded"]["val_at_start"]
    assert abs(val[0] - val[1]) <= 1e-5 * val[1], val
    assert packing["packed"]["padding_share"] < packing["padded"]["padding_share"]
    assert packing["packed"]["rows"] < packing["padded"]["rows"]


def test_qlora_holds_and_gathers_less_over_an_nf4_base(sections):
    """The NF4 base's model states and ZeRO-3 gathers are below the bf16 base's at the same
    LoRA, and the saved bytes per sequence under recomputation are the estimate's."""
    raw = sections("qlora").raw
    states, gathers = raw["model_states"], raw["all_gather"]
    assert states["qlora-zero2"] < 0.7 * states["lora-zero2"]
    assert gathers["qlora-zero3"] < 0.6 * gathers["lora-zero3"]
    row = next(r for r in sections("qlora").rows if "saved bytes per sequence" in r.what)
    assert abs(row.ratio - 1) < 0.02


def test_bad_requests_exit_2_before_anything_runs(tmp_path, capsys):
    assert main(["lessons", "--only", "dp", "--only", "nope", "--out", str(tmp_path)]) == 2
    known = (
        "dp, pipeline, tp, zero, precision, recompute, offload, offload-activations, "
        "partition-activations, finetune, lora, qlora, light-loss"
    )
    assert f"unknown lesson nope; known: {known}" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["lessons", "--out", str(tmp_path / "file" / "sub")]) == 2
    err = capsys.readouterr().err
    assert (
        f"--out '{tmp_path / 'file' / 'sub'}' cannot be made: '{tmp_path / 'file'}' is a file"
        in err
    )
    assert not list(tmp_path.glob("**/lessons.md"))


def test_too_few_cores_says_so_and_runs_with_fewer_processes():
    said: list[str] = []
    assert choose_procs(2, said.append) == 2
    assert said == ["2 CPU cores: lessons run with 2 processes instead of 4"]
    assert choose_procs(1, said.append) == 2 and "sharing one core" in said[-1]
    assert choose_procs(8, said.append) == 4 and len(said) == 2


class _Counted(torch.autograd.Function):
    """Records one collective forward and one backward, as tp's f/g do through Comm."""

    @staticmethod
    def forward(ctx, x, stats):
        ctx.stats = stats
        stats.record("all_reduce", "tp", x, "fwd")
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.stats.record("all_gather", "tp", grad, "bwd")
        return grad, None


class _Toy(torch.nn.Module):
    def __init__(self, stats: CommStats) -> None:
        super().__init__()
        self.w, self.stats = torch.nn.Parameter(torch.ones(3)), stats

    def forward(self, x):
        return _Counted.apply(self.w * x, self.stats).sum()


def test_phase_meter_splits_forward_backward_and_step():
    stats = CommStats()
    model, meter = _Toy(stats), PhaseMeter(stats)
    for step in range(2):  # two micro-batches, then once-per-step work
        stats.begin_step(step)
        with meter.attached(model):
            for _ in range(2):
                model(torch.ones(3)).backward()
            meter.mark("step")
        stats.record("all_reduce", "tp", torch.zeros(1, dtype=torch.float64), "grad_norm")
        phases = meter.take()
    got = [(p["phase"], [(c["op"], c["tag"], c["calls"], c["bytes"]) for c in p["counts"]])
           for p in phases]  # fmt: skip
    fwd, bwd = (
        ("forward", [("all_reduce", "fwd", 1, 12)]),
        ("backward", [("all_gather", "bwd", 1, 12)]),
    )
    assert got == [fwd, bwd, fwd, bwd, ("step", [("all_reduce", "grad_norm", 1, 8)])]
    stats.begin_step(2)
    model(torch.ones(3))  # detached: no marks, everything lands before the first one
    assert [p["phase"] for p in meter.take()] == ["before"]


def test_partitioned_activations_hold_less_for_their_gathers(sections):
    """Each recompute mode holds less per rank with partitioning, by the estimate's
    difference, and gathers what the formula says; the estimate's gap to the meter is the
    same with and without."""
    raw = sections("partition-activations").raw
    held, est, gathered = raw["measured"], raw["estimate"], raw["all_gather_bytes"]
    for mode in ("full", "selective"):
        on = f"{mode}+partition"
        assert held[on] < held[mode] and gathered[on] > gathered[mode]
        assert held[on] - est[on] == held[mode] - est[mode], mode
