"""Pipeline schedules as data: every schedule validates over a grid of sizes; the validator
catches broken schedules with messages that name rank, action and reason; bad sizes fail early."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from plait.errors import ConfigError
from plait.schedule.actions import Action, Kind, Schedule
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
from plait.schedule.simulate import simulate
from plait.schedule.validate import ScheduleError, validate
from schedule_grid import grid

_TOKEN = re.compile(r"(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)\.(\d+)(?:[<>](\d+))?$")


def parse(text: str) -> tuple[Action, ...]:
    """`F0.0 SEND_F0.0>1 ... STEP` (the form Action.__str__ prints) -> actions."""
    out = []
    for token in text.split():
        if token == "STEP":
            out.append(Action(Kind.STEP))
            continue
        kind, mb, chunk, peer = _TOKEN.match(token).groups()
        out.append(Action(Kind(kind), int(mb), int(chunk), None if peer is None else int(peer)))
    return tuple(out)


def with_rank(s: Schedule, rank: int, actions) -> Schedule:
    ranks = list(s.ranks)
    ranks[rank] = tuple(actions)
    return replace(s, ranks=tuple(ranks))


def compute_order(s: Schedule, rank: int) -> str:
    return " ".join(str(a) for a in s.ranks[rank] if a.is_compute)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_validates_over_the_grid(name):
    for p, m, v in grid(name):
        s = build_schedule(name, p, m, v)
        assert (s.p, s.m, s.v, len(s.ranks)) == (p, m, v, p)
        validate(s)


def test_action_and_schedule_text():
    assert str(Action(Kind.F, 3, 1)) == "F3.1"
    assert str(Action(Kind.SEND_F, 3, 1, peer=2)) == "SEND_F3.1>2"
    assert str(Action(Kind.RECV_B, 0, 0, peer=1)) == "RECV_B0.0<1"
    assert str(Action(Kind.STEP, step=1, version=2)) == "STEP s1 v2"
    text = str(one_f_one_b(2, 2))
    assert text.splitlines()[0] == "1f1b p=2 m=2 v=1"
    assert text.splitlines()[1].startswith("rank 0: F0.0 SEND_F0.0>1")


def test_stage_mapping_is_megatrons():
    s = interleaved(4, 8, 2)
    assert [s.stage(r, c) for c in range(2) for r in range(4)] == list(range(8))
    assert all(s.location(s.stage(r, c)) == (r, c) for r in range(4) for c in range(2))
    # the last rank's chunk 0 feeds rank 0's chunk 1
    sends = [a for a in s.ranks[3] if a.kind is Kind.SEND_F and a.chunk == 0]
    assert {a.peer for a in sends} == {0}


def test_1f1b_reads_as_warmup_steady_cooldown():
    s = one_f_one_b(4, 6)
    assert compute_order(s, 0) == ("F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 B3.0 B4.0 B5.0")
    assert compute_order(s, 3) == "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0 F4.0 B4.0 F5.0 B5.0"
    assert str(s.ranks[3][0]) == "RECV_F0.0<2"
    assert s.ranks[0][-1].kind is Kind.STEP


def test_naive_sends_each_microbatch_round_trip_before_the_next():
    s = naive(3, 2)
    for rank in range(3):
        assert compute_order(s, rank) == "F0.0 B0.0 F1.0 B1.0"
    assert simulate(s).peak_in_flight == (1, 1, 1)


def test_gpipe_runs_all_forwards_first():
    assert compute_order(gpipe(2, 3), 1) == "F0.0 F1.0 F2.0 B0.0 B1.0 B2.0"


def test_interleaved_groups_of_p_microbatches_per_chunk():
    s = interleaved(2, 4, 2)
    fwd = [str(a) for a in s.ranks[0] if a.kind is Kind.F]
    assert fwd == ["F0.0", "F1.0", "F0.1", "F1.1", "F2.0", "F3.0", "F2.1", "F3.1"]
    bwd = [str(a) for a in s.ranks[0] if a.kind is Kind.B]
    assert bwd == ["B0.1", "B1.1", "B0.0", "B1.0", "B2.1", "B3.1", "B2.0", "B3.0"]


def test_zb_h1_defers_w_by_rank():
    s = zb_h1(3, 4)
    assert compute_order(s, 0).startswith("F0.0 F1.0 F2.0 B0.0 W0.0 F3.0 B1.0 W1.0")
    assert compute_order(s, 2).startswith("F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 W0.0")
    assert compute_order(s, 2).endswith("B3.0 W1.0 W2.0 W3.0")
    assert s.split_backward


def test_2bw_versions_in_the_data():
    s = two_bw(2, 2, steps=3)
    assert s.steps == 3 and s.weight_versions
    for acts in s.ranks:
        for a in acts:
            if a.kind in (Kind.F, Kind.B):
                assert a.version == max(a.step - 1, 0)
        steps = [a for a in acts if a.kind is Kind.STEP]
        assert [(a.step, a.version) for a in steps] == [(0, 1), (1, 2), (2, 3)]


# --- the validator catches broken schedules -------------------------------------------------


def test_dropped_receive_is_named():
    s = one_f_one_b(3, 4)
    acts = list(s.ranks[1])
    dropped = next(i for i, a in enumerate(acts) if a.kind is Kind.RECV_F and a.microbatch == 2)
    del acts[dropped]
    with pytest.raises(
        ScheduleError, match=r"rank 0, action \d+ \(SEND_F2.0>1\): no matching receive on rank 1"
    ):
        validate(with_rank(s, 1, acts))


def test_receive_order_must_match_send_order():
    s = gpipe(2, 2)
    broken = with_rank(
        s, 1, parse("RECV_F1.0<0 RECV_F0.0<0 F0.0 F1.0 B0.0 SEND_B0.0>0 B1.0 SEND_B1.0>0 STEP")
    )
    with pytest.raises(ScheduleError, match=r"rank 1, action 0 \(RECV_F1.0<0\): .*same order"):
        validate(broken)


def test_swapped_order_deadlock_is_named():
    s = one_f_one_b(2, 2)
    # rank 0 waits for a gradient before sending the activations that produce it
    broken = with_rank(
        s, 0, parse("F0.0 RECV_B0.0<1 SEND_F0.0>1 F1.0 SEND_F1.0>1 B0.0 RECV_B1.0<1 B1.0 STEP")
    )
    with pytest.raises(ScheduleError) as err:
        validate(broken)
    assert "deadlock with buffered sends" in str(err.value)
    assert "rank 0, action 1 (RECV_B0.0<1)" in str(err.value)
    assert "waits for rank 1 action" in str(err.value)
    assert (err.value.rank, err.value.index) == (0, 1)


def test_rendezvous_deadlock_is_caught():
    """Interleaved 1F1B with each receive posted lazily right before its use: fine with buffered
    sends, but with batched rendezvous sends both ranks block on a send (why schedules prefetch)."""
    lazy = [
        "F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_F0.1<1 F0.1 SEND_F0.1>1 RECV_F1.1<1 F1.1 "
        "SEND_F1.1>1 F2.0 SEND_F2.0>1 RECV_B0.1<1 B0.1 SEND_B0.1>1 F3.0 SEND_F3.0>1 RECV_B1.1<1 "
        "B1.1 SEND_B1.1>1 RECV_F2.1<1 F2.1 SEND_F2.1>1 RECV_B0.0<1 B0.0 RECV_F3.1<1 F3.1 "
        "SEND_F3.1>1 RECV_B1.0<1 B1.0 RECV_B2.1<1 B2.1 SEND_B2.1>1 RECV_B3.1<1 B3.1 SEND_B3.1>1 "
        "RECV_B2.0<1 B2.0 RECV_B3.0<1 B3.0 STEP",
        "RECV_F0.0<0 F0.0 SEND_F0.0>0 RECV_F1.0<0 F1.0 SEND_F1.0>0 RECV_F0.1<0 F0.1 B0.1 "
        "SEND_B0.1>0 RECV_F1.1<0 F1.1 B1.1 SEND_B1.1>0 RECV_F2.0<0 F2.0 SEND_F2.0>0 RECV_B0.0<0 "
        "B0.0 SEND_B0.0>0 RECV_F3.0<0 F3.0 SEND_F3.0>0 RECV_B1.0<0 B1.0 SEND_B1.0>0 RECV_F2.1<0 "
        "F2.1 B2.1 SEND_B2.1>0 RECV_F3.1<0 F3.1 B3.1 SEND_B3.1>0 RECV_B2.0<0 B2.0 SEND_B2.0>0 "
        "RECV_B3.0<0 B3.0 SEND_B3.0>0 STEP",
    ]
    s = replace(interleaved(2, 4, 2), ranks=tuple(parse(t) for t in lazy))
    with pytest.raises(ScheduleError, match="deadlock with batched rendezvous sends"):
        validate(s)


def test_backward_before_forward():
    s = one_f_one_b(3, 3)
    acts = list(s.ranks[2])
    f, b = acts.index(Action(Kind.F, 0)), acts.index(Action(Kind.B, 0))
    acts[f], acts[b] = acts[b], acts[f]
    with pytest.raises(
        ScheduleError, match=r"rank 2, action 1 \(B0.0\): backward before its forward"
    ):
        validate(with_rank(s, 2, acts))


def test_weight_gradient_before_input_gradient():
    s = zb_h1(2, 2)
    acts = list(s.ranks[1])
    b, w = acts.index(Action(Kind.B, 1)), acts.index(Action(Kind.W, 1))
    acts.insert(b, acts.pop(w))
    with pytest.raises(ScheduleError, match=r"W1.0\): weight gradient \(W\) before"):
        validate(with_rank(s, 1, acts))


def test_missing_weight_gradient():
    s = zb_h1(2, 2)
    acts = [a for a in s.ranks[0] if a != Action(Kind.W, 1)]
    with pytest.raises(ScheduleError, match=r"rank 0.*STEP.*before all backwards of step 0"):
        validate(with_rank(s, 0, acts))


def test_missing_forward_and_backward_counted():
    s = gpipe(1, 2)
    with pytest.raises(ScheduleError, match=r"rank 0: 0 B for micro-batch 1 chunk 0 step 0"):
        validate(with_rank(s, 0, parse("F0.0 F1.0 B0.0")))


def test_wrong_peer():
    s = one_f_one_b(3, 1)
    acts = [replace(a, peer=2) if a.kind is Kind.SEND_F else a for a in s.ranks[0]]
    with pytest.raises(ScheduleError, match=r"rank 0, action 1 .*peer should be rank 1"):
        validate(with_rank(s, 0, acts))


def test_w_in_fused_schedule_rejected():
    s = gpipe(1, 1)
    with pytest.raises(ScheduleError, match="split_backward False"):
        validate(with_rank(s, 0, parse("F0.0 B0.0 W0.0 STEP")))


def test_2bw_version_errors():
    s = two_bw(2, 2)
    acts = list(s.ranks[1])
    i = next(i for i, a in enumerate(acts) if a.kind is Kind.B)
    acts[i] = replace(acts[i], version=1)
    with pytest.raises(ScheduleError, match="backward with version 1, forward used 0"):
        validate(with_rank(s, 1, acts))
    acts = [
        replace(a, version=1) if a.kind in (Kind.F, Kind.B) and a.step == 1 else a
        for a in s.ranks[0]
    ]
    with pytest.raises(ScheduleError, match=r"rank 0.*uses weight version 1, not produced yet"):
        validate(with_rank(s, 0, acts))


# --- clear errors for bad sizes -------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: one_f_one_b(0, 4),
            r"1f1b: p \(pipeline stages\) must be a positive integer, got 0",
        ),
        (lambda: gpipe(2, 0), r"m \(micro-batches\) must be a positive integer, got 0"),
        (lambda: zb_h1(2, 2, 0), r"v must be a positive integer, got 0"),
        (lambda: one_f_one_b(True, 2), "got True"),
        (lambda: gpipe(2, 4, 2), "gpipe does not interleave: virtual stages v must be 1, got v=2"),
        (lambda: interleaved(4, 8, 1), "interleaved needs v >= 2 virtual stages per rank, got v=1"),
        (lambda: interleaved(4, 6, 2), "m a multiple of p, got m=6, p=4"),
        (lambda: interleaved(1, 2, 2), "interleaved needs p >= 2 pipeline stages, got p=1"),
        (lambda: two_bw(4, 3), "2bw needs micro-batches m >= p .* got m=3, p=4"),
        (lambda: two_bw(2, 2, steps=0), "steps must be a positive integer, got 0"),
        (
            lambda: build_schedule("pipedream", 2, 2),
            "unknown schedule 'pipedream'; known: naive, gpipe, 1f1b",
        ),
    ],
)
def test_config_errors(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


def test_registry_is_read_only():
    with pytest.raises(TypeError):
        SCHEDULES["mine"] = gpipe  # type: ignore[index]
    assert list(SCHEDULES) == ["naive", "gpipe", "1f1b", "interleaved", "zb-h1", "2bw"]
