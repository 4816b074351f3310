"""The simulator reproduces the published pipeline results exactly with unit costs.

Costs(f, b, w): forward, input-gradient and weight-gradient time of one stage and micro-batch;
a fused backward costs b + w. Fractions keep every number exact.
"""

from __future__ import annotations

from fractions import Fraction as Fr
from itertools import pairwise

import pytest

from plait.schedule.actions import Kind, TimedAction
from plait.schedule.schedules import (
    SCHEDULES,
    build_schedule,
    gpipe,
    interleaved,
    naive,
    one_f_one_b,
    two_bw,
    zb_h1,
)
from plait.schedule.simulate import Costs, measure, predicted_bubble, simulate
from schedule_grid import grid


def unit(v: int = 1) -> Costs:
    return Costs(Fr(1, v), Fr(1, v), Fr(1, v))


@pytest.mark.parametrize(
    ("schedule", "makespan", "bubble"),
    [
        (naive(4, 8), 96, Fr(3, 4)),  # one stage busy at a time: (p-1)/p, makespan p·m·T
        (gpipe(4, 8), 33, Fr(3, 11)),  # (p-1)/(m+p-1), makespan (m+p-1)(T_F+T_B)
        (one_f_one_b(4, 8), 33, Fr(3, 11)),
        (interleaved(4, 8, 2), Fr(57, 2), Fr(3, 19)),  # bubble time 9 / v = 4.5 of 24 work
        (interleaved(4, 8, 4), Fr(105, 4), Fr(3, 35)),
        (zb_h1(4, 8), 27, Fr(1, 9)),  # bubble time (p-1)(T_F+T_B-T_W) = 3 of 24 work
        (two_bw(4, 8), 57, Fr(3, 19)),  # one fill and drain for 2 steps: (p-1)/(2m+p-1)
    ],
    ids=["naive", "gpipe", "1f1b", "interleaved-v2", "interleaved-v4", "zb-h1", "2bw"],
)
def test_published_numbers(schedule, makespan, bubble):
    sim = simulate(schedule, unit(schedule.v))
    assert sim.makespan == makespan
    assert sim.bubble_fraction == bubble
    assert predicted_bubble(schedule, unit(schedule.v)) == bubble


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_formula_holds_over_the_grid(name):
    """Exact for every size and for backward/forward ratios other than 2 as well."""
    for p, m, v in grid(name):
        s = build_schedule(name, p, m, v)
        for costs in (
            unit(v),
            Costs(Fr(1, v), Fr(2, v), Fr(1, v)),
            Costs(Fr(2, v), Fr(1, v), Fr(1, v)),
        ):
            sim = simulate(s, costs)
            assert sim.bubble_fraction == predicted_bubble(s, costs), (p, m, v, costs)


def test_bubble_formulas_in_closed_form():
    for p in range(1, 6):
        for m in range(p, 3 * p + 1):
            assert simulate(one_f_one_b(p, m)).bubble_fraction == Fr(p - 1, m + p - 1)
            assert simulate(gpipe(p, m)).bubble_fraction == Fr(p - 1, m + p - 1)
            zb = simulate(zb_h1(p, m))  # f = b = w = 1: bubble time (p-1)·1 per rank
            assert zb.makespan - zb.busy[0] == p - 1
            if p >= 2 and m % p == 0:
                for v in (2, 3):
                    il = simulate(interleaved(p, m, v), unit(v))
                    one = simulate(one_f_one_b(p, m))
                    assert (il.makespan - il.busy[0]) * v == one.makespan - one.busy[0]


def test_peak_in_flight():
    p, m = 4, 8
    assert simulate(gpipe(p, m)).peak_in_flight == (m,) * p
    assert simulate(one_f_one_b(p, m)).peak_in_flight == (4, 3, 2, 1)
    assert simulate(one_f_one_b(p, 2)).peak_in_flight == (2, 2, 2, 1)
    assert simulate(zb_h1(p, m)).peak_in_flight == (4, 3, 2, 1)  # same as 1F1B
    assert simulate(two_bw(p, m)).peak_in_flight == (4, 3, 2, 1)
    # interleaved (m > p): 2(p-r-1) + (v-1)p + 1 chunk activations, each 1/v of a stage's:
    # p + (p-2r-1)/v stages, p + (p-1)/v on rank 0
    for p in range(2, 6):
        for m, v in ((2 * p, 2), (3 * p, 2), (2 * p, 3)):
            peaks = simulate(interleaved(p, m, v), unit(v)).peak_in_flight
            assert peaks == tuple(2 * (p - r - 1) + (v - 1) * p + 1 for r in range(p))
            assert Fr(peaks[0], v) == p + Fr(p - 1, v)
    for p in range(1, 6):
        for m in range(1, 3 * p + 1):
            peaks = simulate(one_f_one_b(p, m)).peak_in_flight
            assert peaks == tuple(min(p - r, m) for r in range(p))


def test_2bw_two_versions_no_flush_same_version_for_f_and_b():
    for p in range(1, 6):
        for m in range(p, 2 * p + 1):
            sim = simulate(two_bw(p, m, steps=3))
            assert max(sim.peak_weight_versions) <= 2
            rank0 = [t for t in sim.timings if t.rank == 0]
            last_b0 = max(t.end for t in rank0 if t.action.kind is Kind.B and t.action.step == 0)
            first_f1 = min(t.start for t in rank0 if t.action.kind is Kind.F and t.action.step == 1)
            if p > 1:
                assert first_f1 < last_b0, "step 1 must start before step 0 drains (no flush)"
                assert sim.peak_weight_versions[0] == 2
            for acts in sim.schedule.ranks:
                f = {(a.step, a.microbatch): a.version for a in acts if a.kind is Kind.F}
                b = {(a.step, a.microbatch): a.version for a in acts if a.kind is Kind.B}
                assert f == b
    for s in (gpipe(3, 3), one_f_one_b(3, 3), zb_h1(3, 3)):
        assert simulate(s).peak_weight_versions == (1, 1, 1)


def test_costs_per_stage_and_communication():
    s = one_f_one_b(4, 8)
    assert simulate(s, Costs(f=(1, 1, 1, 1))).makespan == simulate(s).makespan
    slow_last = simulate(s, Costs(f=(1, 1, 1, 2), b=(1, 1, 1, 2), w=(1, 1, 1, 2)))
    assert slow_last.makespan >= 8 * (2 + 2 + 2)  # the slow stage alone needs m·(f+b+w)
    assert predicted_bubble(s, Costs(f=(1, 1, 1, 2))) is None
    # one micro-batch through two stages: f, comm, f, b+w, comm, b+w
    two = simulate(one_f_one_b(2, 1), Costs(f=1, b=1, w=1, comm=Fr(1, 2)))
    assert two.makespan == 1 + Fr(1, 2) + 1 + 2 + Fr(1, 2) + 2
    assert predicted_bubble(one_f_one_b(2, 1), Costs(comm=1)) is None


def test_timings_are_sequential_per_rank():
    sim = simulate(interleaved(3, 6, 2), unit(2))
    for r in range(3):
        ts = [t for t in sim.timings if t.rank == r]
        assert [t.index for t in ts] == list(range(len(sim.schedule.ranks[r])))
        assert all(a.end <= b.start for a, b in pairwise(ts))
    assert max(t.end for t in sim.timings) == sim.makespan


def test_measure_uses_the_simulators_definition_on_shifted_records():
    """A runtime's records start at wall-clock time, not 0: same bubble."""
    sim = simulate(zb_h1(3, 5))
    shifted = [
        TimedAction(t.rank, t.index, t.action, t.start + 100, t.end + 100) for t in sim.timings
    ]
    assert measure(shifted, 3) == (sim.makespan, sim.busy, sim.bubble_fraction)
