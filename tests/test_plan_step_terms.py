"""The planner's terms for ranks that share cores (processor-sharing simulation), the
optimizer's pass and the step's small collectives, on hand-checked small cases. That the
small collectives are the ones a run counts is asserted in tests/test_estimate_measured.py."""

from __future__ import annotations

import dataclasses
import random

import pytest

from plait.calibrate_runtime import action_overhead
from plait.plan.hardware import Hardware, Link, OpCost
from plait.plan.shared import shared_makespan
from plait.plan.step_time import Memo, step_time
from plait.plan.traffic import step_collectives
from plait.schedule.schedules import build_schedule
from plait.schedule.simulate import Costs, simulate
from sections import build_regrouped

GIB = 2**30


def _hw(alpha: float = 0.0, beta: float = 1e30, **kw) -> Hardware:
    link = Link({"all_reduce": OpCost(alpha, beta)})
    base = dict(name="test", peak_flops=1e12, achievable=0.5, memory=80 * GIB,
                host_bandwidth=1e10, disk_bandwidth=1e9, intra=link, inter=link,
                precision="fp32", overlap=0.0)  # fmt: skip
    return Hardware(**{**base, **kw})


def _cfg(preset: str = "tiny-gpt", **par):
    train = {k: par.pop(k) for k in ("global_batch", "micro_batch") if k in par}
    cfg = build_regrouped(preset, {"parallel": par, "train": {"seq_len": 32, **train}})
    cfg.validate()
    return cfg


# ---------------------------------------------------------------- processor sharing
def test_shared_pipeline_hand_checked():
    """GPipe p=2, m=2, F=2, B=1 (unsplit), free p2p, 1.5 ranks' worth of cores: rank 0's F0
    alone (0-2); F1 on rank 0 and F0 on rank 1 together at 0.75 (2-4.67); rank 1's F1 alone
    (-6.67) and its first B (-7.67); its second B with rank 0's first at 0.75 (-9); rank 0's
    last B alone (-10). Each bound alone says 9 (the critical path) or 8 (work / pool)."""
    sched = build_schedule("gpipe", 2, 2)
    costs = Costs(2, 1, 0, 0)
    assert shared_makespan(sched, costs, 1.5) == pytest.approx(10.0)
    assert float(simulate(sched, costs).makespan) == 9.0
    assert shared_makespan(sched, costs, 2) == pytest.approx(9.0)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2),
                                    ("gpipe", 1), ("naive", 1)])  # fmt: skip
def test_a_pool_of_every_rank_is_the_unshared_simulation(name, v):
    rnd = random.Random(7)
    for p, m in ((2, 4), (4, 8), (3, 5)):
        if v > 1 and m % p:
            continue
        n = p * v
        costs = Costs(*([rnd.uniform(0.5, 2) for _ in range(n)] for _ in range(3)), 0.1)
        sched = build_schedule(name, p, m, v)
        want = float(simulate(sched, costs).makespan)
        assert shared_makespan(sched, costs, p) == pytest.approx(want, rel=1e-9)
        work = sum(sum(costs.f) + sum(costs.b) + sum(costs.w) for _ in range(m))
        shared = shared_makespan(sched, costs, p / 2)
        assert shared >= max(want, work / (p / 2)) * (1 - 1e-9)  # both bounds hold


def test_bad_pool_is_refused():
    with pytest.raises(ValueError, match="pool must be > 0"):
        shared_makespan(build_schedule("1f1b", 2, 2), Costs(), 0)


# ---------------------------------------------------------------- optimizer and small collectives
def test_optimizer_term_is_the_shard_times_the_per_element_cost():
    hw = _hw(optimizer_s_per_element=1e-9)
    whole = step_time(_cfg(dp=2, global_batch=4, micro_batch=2), hw, 8, Memo())
    shard = step_time(_cfg(dp=2, zero=1, global_batch=4, micro_batch=2), hw, 8, Memo())
    assert whole.optimizer > 0 and shard.optimizer == pytest.approx(whole.optimizer / 2, rel=0.01)
    off = _cfg(dp=2, zero=2, offload="cpu", global_batch=4, micro_batch=2)
    host = step_time(off, hw, 8, Memo())  # the host's Adam: master, moments, gradient
    on_device = step_time(_cfg(dp=2, zero=2, global_batch=4, micro_batch=2), hw, 8, Memo())
    elements = on_device.optimizer / 1e-9  # the zero-2 shard
    # read and write the fp32 master and two moments, read the gradient: 28 B per element
    assert host.optimizer == pytest.approx(max(on_device.optimizer, 28 * elements / 1e10))
    slow_device = dataclasses.replace(hw, optimizer_s_per_element=1e-6)  # a CPU "device"
    assert step_time(off, slow_device, 8, Memo()).optimizer == pytest.approx(
        step_time(
            _cfg(dp=2, zero=2, global_batch=4, micro_batch=2), slow_device, 8, Memo()
        ).optimizer
    )  # offloading to the same memory is never faster than not offloading


def test_small_collectives_of_a_pipeline_are_priced_as_latencies():
    cfg = _cfg(pp=2, global_batch=4, micro_batch=2)
    got = step_collectives(cfg, _rank_plans(cfg, 0))
    table = cfg.model.vocab_size * cfg.model.d_model  # tiny-gpt ties its embedding
    assert got == {("pp", "loss"): (1, 1, 4), ("pp", "grad_norm"): (1, 1, 8),
                   ("pp_ends", "tied_embedding"): (1, table, 4)}  # fmt: skip
    hw = _hw(alpha=1e-3, beta=1e9)
    t = step_time(cfg, hw, 8, Memo())  # all-reduce over 2: 2 ring steps, factor 1
    assert t.sync == pytest.approx(3 * 2 * 1e-3 + (4 + 8 + 4 * table) / 1e9)
    sp_cfg = _cfg("small-llama", tp=2, sequence_parallel=True, zero=1, dp=2, global_batch=4,
                  micro_batch=2)  # fmt: skip
    sp = step_collectives(sp_cfg, _rank_plans(sp_cfg, 0))
    assert set(sp) == {("dp", "loss"), ("dp", "grad_norm"), ("tp", "grad_norm"),
                       ("tp", "tp-sp-grads")}  # fmt: skip


def _rank_plans(cfg, rank: int):
    from plait.schedule.stages import rank_plans

    par = cfg.parallel
    return rank_plans(cfg.model.n_layers, par.pp, par.virtual_stages, rank)


def test_terms_sum_to_the_total():
    hw = _hw(alpha=1e-4, beta=1e9, optimizer_s_per_element=1e-9, contention=2.0)
    t = step_time(_cfg(pp=2, dp=2, global_batch=8, micro_batch=2), hw, 8, Memo())
    parts = dataclasses.asdict(t)
    assert t.total == pytest.approx(sum(parts.values()))
    assert min(parts.values()) >= -1e-12


def test_calibrated_profile_carries_the_optimizer_probe(tmp_path):
    import torch

    from plait.calibrate import _optimizer_s_per_element, profile_of
    from plait.device import threads_per_worker
    from plait.plan.hardware import load_hardware, save_hardware

    class Alone:  # a one-rank stand-in for the calibration world's Comm
        def barrier(self) -> None:
            pass

    # With a calibrate worker's share of the cores (two ranks: threads_per_worker(2)), not
    # all of them: torch's threads spin-wait for each other when another process holds a
    # core, which on a loaded machine made this probe a hundred times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_worker(2))
    try:
        per_element = _optimizer_s_per_element(Alone(), repeats=2, n=2**14)
    finally:
        torch.set_num_threads(threads)
    assert 0 < per_element < 1e-6  # element-wise kernels: nanoseconds per element here
    rows = [(op, 2, b, 1e-4 + b / 1e9) for op in ("all_reduce", "all_gather", "reduce_scatter",
                                                 "p2p") for b in (4096, 2**20)]  # fmt: skip
    result = {"flops": {"peak": 1e10, "achievable": 0.5, "overhead": 1e-4}, "rows": rows,
              "optimizer": per_element, "bandwidth": {"host": 1e10, "disk": 1e9},
              "pipeline": {"world": 2, "m": 8, "message": 1024, "step_s": 0.05}}  # fmt: skip
    hw = profile_of(result, 2)
    save_hardware(hw, tmp_path / "hw.toml")
    back = load_hardware(str(tmp_path / "hw.toml"))
    assert back.optimizer_s_per_element == per_element
    message = 1e-4 + 1024 / 1e9  # the p2p fit of the rows above
    assert back.action_overhead_s == pytest.approx(action_overhead(0.05, 2, 8, message))


def test_runtime_probe_is_solved_through_the_simulator():
    """1F1B, p=2, m=8, messages free: 2(m + p - 1) actions on the critical path."""
    assert action_overhead(0.09, 2, 8, 0.0) == pytest.approx(0.09 / 18)
    sched = build_schedule("1f1b", 4, 16)
    span = float(simulate(sched, Costs(2e-3, 2e-3, 0, 5e-4)).makespan)
    assert action_overhead(span, 4, 16, 5e-4) == pytest.approx(2e-3, rel=1e-6)
    assert action_overhead(1e-4, 4, 16, 5e-4) == 0.0  # the messages alone take longer


def test_runtime_term_is_per_action_in_pipelines_only():
    hw = _hw(action_overhead_s=1e-3)
    assert step_time(_cfg(dp=2, global_batch=8, micro_batch=2), hw, 8, Memo()).runtime == 0
    for schedule, actions in (("1f1b", 2), ("zb-h1", 3)):
        t = step_time(_cfg(pp=2, schedule=schedule, global_batch=8, micro_batch=2), hw, 8, Memo())
        assert t.runtime == pytest.approx(4 * actions * 1e-3)  # 4 micro-batches, one chunk


def test_calibrate_refuses_what_it_cannot_write_before_measuring(tmp_path, capsys):
    from plait.cli import main

    assert main(["calibrate", "--out", str(tmp_path / "no" / "hw.toml")]) == 2
    assert main(["calibrate", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    missing = tmp_path / "no"
    assert f"--out '{missing / 'hw.toml'}': its folder '{missing}' does not exist" in err
    assert f"--out '{tmp_path}' is a folder; give a file path" in err


def test_ctrl_c_stops_calibrate_and_every_rank(tmp_path):
    """Ctrl-C reaches the whole group: the workers ignore it, the parent stops them all,
    says so in one line, exits 130 and writes nothing. The Ctrl-C is sent once both workers
    ignore it (they pause at the 'calibrate' phase), not after a fixed time: a worker still
    importing would take it as a KeyboardInterrupt."""
    import os
    import signal
    import subprocess
    import sys

    from phases import pause_env, wait_for_phase

    out = tmp_path / "hw.toml"
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait.cli", "calibrate", "--ranks", "2", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        env={**os.environ, **pause_env("calibrate", tmp_path)},
    )  # fmt: skip
    try:
        wait_for_phase(tmp_path, "calibrate", ["rank0", "rank1"], proc)
        os.killpg(proc.pid, signal.SIGINT)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert f"plait: calibrate interrupted; every rank stopped, {out} not written" in err
    assert "Traceback" not in err and not out.exists()
