"""The planner: hardware profiles, each term of the step-time model, enumeration and
ranking on hand-checked small cases, the TOML it writes, and its bad-input messages."""

from __future__ import annotations

import dataclasses

import pytest

from plait.cli import build_parser, config_from_args, main
from plait.errors import ConfigError
from plait.estimate import estimate
from plait.estimate.formulas import tp_comm_per_microbatch, zero_comm_elements
from plait.estimate.rank_params import total_parameters
from plait.models.presets import get_preset
from plait.models.transformer import matmul_flops_per_token
from plait.plan.enumerate import Request, shapes
from plait.plan.hardware import (
    Hardware,
    Link,
    OpCost,
    load_hardware,
    parse_size,
    save_hardware,
)
from plait.plan.search import memory_schedule, plan
from plait.plan.step_time import Memo, chunk_cost, makespan, step_time
from plait.plan.traffic import Links
from plait.schedule.schedules import build_schedule
from plait.schedule.simulate import Costs, simulate
from sections import build_regrouped

GIB = 2**30
SCHEDULES = (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2))


def _hw(alpha: float = 0.0, beta: float = 1e9, overlap: float = 0.0, **kw) -> Hardware:
    link = Link({"all_reduce": OpCost(alpha, beta)})
    base = dict(
        name="test",
        peak_flops=1e12,
        achievable=0.5,
        memory=80 * GIB,
        host_bandwidth=1e10,
        disk_bandwidth=1e9,
        intra=link,
        inter=link,
        precision="fp32",
        overlap=overlap,
    )
    return Hardware(**{**base, **kw})


def _cfg(preset: str = "tiny-gpt", **par):
    train = {k: par.pop(k) for k in ("global_batch", "micro_batch", "seq_len") if k in par}
    cfg = build_regrouped(preset, {"parallel": par, "train": {"seq_len": 32, **train}})
    cfg.validate()
    return cfg


# ---------------------------------------------------------------- hardware
def test_shipped_profiles_and_round_trip(tmp_path):
    h100 = load_hardware("h100")
    assert h100.peak_flops == 989.5e12 and h100.memory == 80 * GIB  # datasheet, dense bf16
    assert load_hardware("a100").peak_flops == 312e12
    assert load_hardware("cpu").precision == "fp32"
    path = tmp_path / "hw.toml"
    save_hardware(h100, path)
    assert load_hardware(str(path)) == h100


def test_ring_alpha_beta_and_fallback():
    link = Link({"all_reduce": OpCost(1e-3, 1e9), "p2p": OpCost(2e-3, 4e9)})
    # all-reduce over 4: 2(n-1) = 6 steps, 2(n-1)/n = 1.5 of the bytes
    assert link.time("all_reduce", 4, 8e9) == pytest.approx(6e-3 + 12.0)
    # all-gather falls back to all-reduce's numbers: n-1 = 3 steps, 3/4 of the bytes
    assert link.time("all_gather", 4, 8e9, calls=2) == pytest.approx(2 * 3e-3 + 6.0)
    assert link.time("p2p", 2, 4e9) == pytest.approx(2e-3 + 1.0)
    assert link.time("all_reduce", 1, 8e9) == 0.0
    assert parse_size("80GiB") == 80 * GIB and parse_size("40 GB") == 40 * 10**9


def test_bad_hardware_names_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="neither a shipped profile"):
        load_hardware("tpu-v9")
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\npeak_flops = 1.0\n')
    with pytest.raises(ConfigError, match="missing achievable, memory"):
        load_hardware(str(bad))
    with pytest.raises(ConfigError, match="'eighty'"):
        parse_size("eighty")


# ---------------------------------------------------------------- step-time terms
def test_compute_term_is_model_flops_over_the_rate():
    cfg = _cfg(global_batch=8, micro_batch=2)
    hw = _hw()
    t = step_time(cfg, hw, 8, Memo())
    flops = matmul_flops_per_token(cfg.model, 32) * 8 * 32
    assert t.compute == pytest.approx(flops / hw.flop_rate)
    assert (t.recompute, t.tp, t.bubble, t.dp, t.offload) == (0, 0, pytest.approx(0), 0, 0)


def test_recompute_adds_one_forward_or_attention_only():
    hw, m = _hw(), get_preset("tiny-gpt")
    base = step_time(_cfg(global_batch=8, micro_batch=2), hw, 8, Memo())
    full = step_time(_cfg(global_batch=8, micro_batch=2, recompute="full"), hw, 8, Memo())
    sel = step_time(_cfg(global_batch=8, micro_batch=2, recompute="selective"), hw, 8, Memo())
    head = 2 * m.d_model * m.vocab_size * 8 * 32 / hw.flop_rate  # the head is not recomputed
    assert full.recompute == pytest.approx((base.compute - 3 * head) / 3)
    assert sel.recompute == pytest.approx(m.n_layers * 4 * 32 * m.d_model * 8 * 32 / hw.flop_rate)


def test_dp_term_is_the_exact_bytes_over_the_link():
    hw = _hw(alpha=1e-3, beta=1e8)
    cfg = _cfg(dp=2, global_batch=8, micro_batch=2)  # stage 0: one all-reduce of Ψ fp32
    psi = total_parameters(cfg.model)
    assert zero_comm_elements(0, psi) == {"all_reduce": psi}
    t = step_time(cfg, hw, 8, Memo())
    assert t.dp == pytest.approx(2 * 1e-3 + psi * 4 / 1e8)  # one bucket, 2(n-1) = 2 steps
    hidden = step_time(cfg, dataclasses.replace(hw, overlap=1.0), 8, Memo())
    assert hidden.dp < t.dp  # launched during the backward, hidden by it up to its length


def test_tp_term_prices_the_asserted_collectives():
    hw = _hw(alpha=1e-3, beta=1e8)
    cfg = _cfg(tp=2, global_batch=4, micro_batch=2)  # two micro-batches of 2 x 32 tokens
    fwd, bwd = tp_comm_per_microbatch(2, 2 * 32 * 64, 2 * 32, False)
    calls = sum(c for c, _ in fwd.values()) + sum(c for c, _ in bwd.values())
    nbytes = 4 * (sum(e for _, e in fwd.values()) + sum(e for _, e in bwd.values()))
    t = step_time(cfg, hw, 8, Memo())  # all-reduce over 2: 2 steps, factor 1
    assert t.tp == pytest.approx(2 * (calls * 2 * 1e-3 + nbytes / 1e8))


def test_pipeline_makespan_is_the_simulators_and_extrapolates_exactly():
    hw = _hw(alpha=1e-4)  # p2p slower than compute: the steady state repeats every 2p
    cases = [(m, s, v) for m in (31, 32) for s, v in SCHEDULES if m % 2 == 0 or v == 1]
    for m, schedule, v in cases:
        cfg = _cfg(
            "small-gpt", pp=2, schedule=schedule, virtual_stages=v, global_batch=m, micro_batch=1
        )  # m > 6p: two short simulations, extrapolated
        links = Links.of(cfg, hw, 8)
        costs = [chunk_cost(cfg, hw, links, plan) for plan in _plans(cfg)]
        whole = simulate(
            build_schedule(schedule, 2, m, v),
            Costs([c.f for c in costs], [c.b for c in costs], [c.w for c in costs], 1e-4),
        )
        got = makespan(cfg, costs, 1e-4, Memo())
        assert got == pytest.approx(float(whole.makespan), rel=1e-9), (m, schedule)


def _plans(cfg):
    from plait.schedule.stages import rank_plans

    par = cfg.parallel
    plans = [
        p
        for r in range(par.pp)
        for p in rank_plans(cfg.model.n_layers, par.pp, par.virtual_stages, r)
    ]
    return sorted(plans, key=lambda p: p.stage)


def test_memory_with_a_shortened_schedule_equals_the_whole_one():
    for schedule, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)):
        cfg = _cfg(
            "small-gpt", pp=2, schedule=schedule, virtual_stages=v, global_batch=32, micro_batch=1
        )
        short = estimate(cfg, memory_schedule(cfg, Memo()))
        assert memory_schedule(cfg, Memo()).m == 6
        assert short.to_dict() == estimate(cfg).to_dict(), schedule


# ---------------------------------------------------------------- enumeration and ranking
def _req(**kw) -> Request:
    base = dict(
        model=get_preset("small-gpt"),
        preset="small-gpt",
        gpus=4,
        gpus_per_node=4,
        global_batch=16,
        seq_len=128,
        precision="fp32",
    )
    return Request(**{**base, **kw})


def test_enumeration_divides_model_gpus_and_batch():
    cuts = {(c.dp, c.tp, c.pp) for c in shapes(_req())}
    # small-gpt: 4 heads, 4 layers; tp and pp x dp over 4 GPUs
    assert cuts == {(4, 1, 1), (2, 1, 2), (1, 1, 4), (2, 2, 1), (1, 2, 2), (1, 4, 1)}
    assert {(c.dp, c.tp, c.pp) for c in shapes(_req(gpus_per_node=2))} == cuts - {(1, 4, 1)}
    mbs = {c.micro_batch for c in shapes(_req()) if (c.dp, c.pp) == (4, 1)}
    assert mbs == {1, 2, 4}  # powers of two dividing 16 / 4
    interleaved = {(c.pp, c.virtual_stages) for c in shapes(_req()) if c.schedule == "interleaved"}
    assert interleaved == {(2, 2)}  # pp x v must divide the 4 layers


def test_ranking_with_free_communication_puts_pure_dp_first():
    hw = _hw(overlap=1.0, beta=1e30, precision="fp32")
    out = plan(_req(), hw, 80 * GIB, top=5)
    times = [r.time.total for r in out.ranked]
    assert times == sorted(times)
    best = out.ranked[0]
    assert (best.candidate.pp, best.candidate.recompute) == (1, "none")
    flops = matmul_flops_per_token(get_preset("small-gpt"), 128) * 16 * 128
    assert best.time.total == pytest.approx(flops / 4 / hw.flop_rate)


def test_layouts_that_do_not_fit_are_dropped_with_the_reason():
    out = plan(_req(), _hw(), 1024, top=5)  # 1 KiB devices
    assert not out.ranked and out.dropped
    d = out.dropped[0]
    assert d.need > 1024 and d.largest in ("parameters", "activations", "optimizer_states")


# ---------------------------------------------------------------- the command
PLAN = [
    "plan",
    "--model",
    "small-gpt",
    "--gpus",
    "4",
    "--global-batch",
    "16",
    "--seq-len",
    "128",
    "--hardware",
    "cpu",
]


def test_plan_writes_a_config_that_train_validates(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    assert main([*PLAN, "--top", "3", "--out", str(out)]) == 0
    assert "why it beats" in capsys.readouterr().out
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(out)]), False)
    assert cfg.parallel.layout.world_size == 4 and cfg.train.global_batch == 16


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--tp", "3"],
            "model.n_heads=4 is not divisible by tp=3 (query heads are split across "
            "tp ranks); the nearest tp that work: 2 or 4",
        ),
        (
            ["--pp", "3"],
            "4 layers do not split evenly into pp=3 stages; the nearest pp that do "
            "(and divide 4 GPUs): 2 or 4",
        ),
        (["--gpu-memory", "1KiB"], "nothing fits: none of"),
        (
            ["--gpus", "3", "--tp", "1", "--pp", "1"],
            "no layout of small-gpt (4 layers, 4 heads) "
            "divides 3 GPUs and global batch 16 with tp=1, pp=1",
        ),
    ],
)
def test_bad_input_names_the_numbers(extra, message, capsys):
    argv = [*PLAN, *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split())
    if "nothing fits" in message:
        assert "the closest: dp" in err and "more than" in err


def test_calibration_fit_recovers_alpha_and_beta():
    from plait.calibrate import fit
    from plait.plan.hardware import ring_steps_and_factor

    rows = []
    for op in ("all_reduce", "all_gather"):
        for n in (2, 4):
            for nbytes in (4096, 65536, 2**20, 2**24):
                steps, factor = ring_steps_and_factor(op, n)
                rows.append((op, n, nbytes, steps * 3e-4 + nbytes * factor / 2e9))
    got = fit(rows)
    assert got.alpha_s == pytest.approx(3e-4) and got.beta_bytes_per_s == pytest.approx(2e9)


def test_ranks_sharing_cores_work_through_the_bubble():
    """pp2 with one micro-batch: half the step is bubble on dedicated devices; ranks that
    share cores (contention 2) run twice as fast while the other stage waits."""
    cfg = _cfg("small-gpt", pp=2, schedule="gpipe", global_batch=2, micro_batch=2)
    own, shared = _hw(beta=1e30), _hw(beta=1e30, contention=2.0)  # free p2p
    alone = step_time(cfg, own, 8, Memo())
    pooled = step_time(cfg, shared, 8, Memo())
    links = Links.of(cfg, own, 8)
    costs = [chunk_cost(cfg, own, links, plan) for plan in _plans(cfg)]
    work = [c.f + c.b + c.w for c in costs]
    assert alone.total == pytest.approx(sum(work))  # F0 F1 B1 B0 in series
    assert pooled.total == pytest.approx(max(sum(work) / 2, sum(work) / 2))
    assert pooled.bubble == pytest.approx(0, abs=1e-12)
