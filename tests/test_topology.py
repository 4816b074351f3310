"""Tests for plait.topology: pure rank arithmetic, no processes."""

from __future__ import annotations

import itertools

import pytest

from plait.errors import ConfigError
from plait.topology import AXES, Coord, Layout

LAYOUTS = [(2, 1, 1), (2, 2, 2), (3, 2, 4), (1, 4, 2), (1, 1, 1)]


@pytest.mark.parametrize(("dp", "pp", "tp"), LAYOUTS)
def test_coord_rank_round_trip_for_every_rank(dp: int, pp: int, tp: int) -> None:
    layout = Layout(dp=dp, pp=pp, tp=tp)
    assert layout.world_size == dp * pp * tp
    coords = [layout.coord(r) for r in range(layout.world_size)]
    for r, c in enumerate(coords):
        assert layout.rank(c) == r
        assert 0 <= c.pp < pp and 0 <= c.dp < dp and 0 <= c.tp < tp
    # Every coordinate of the grid is used exactly once.
    grid = {(c.pp, c.dp, c.tp) for c in coords}
    assert grid == set(itertools.product(range(pp), range(dp), range(tp)))


@pytest.mark.parametrize(("dp", "pp", "tp"), LAYOUTS)
def test_rank_order_is_tp_fastest_then_dp_then_pp(dp: int, pp: int, tp: int) -> None:
    layout = Layout(dp=dp, pp=pp, tp=tp)
    expected = [Coord(pp=p, dp=d, tp=t) for p in range(pp) for d in range(dp) for t in range(tp)]
    assert [layout.coord(r) for r in range(layout.world_size)] == expected


def test_concrete_ranks_of_2x2x2() -> None:
    layout = Layout(dp=2, pp=2, tp=2)
    assert layout.coord(0) == Coord(pp=0, dp=0, tp=0)
    assert layout.coord(1) == Coord(pp=0, dp=0, tp=1)
    assert layout.coord(2) == Coord(pp=0, dp=1, tp=0)
    assert layout.coord(4) == Coord(pp=1, dp=0, tp=0)
    assert layout.coord(5) == Coord(pp=1, dp=0, tp=1)
    assert layout.coord(7) == Coord(pp=1, dp=1, tp=1)
    assert layout.rank(Coord(pp=1, dp=1, tp=0)) == 6


def test_concrete_ranks_of_uneven_layout() -> None:
    layout = Layout(dp=3, pp=2, tp=4)
    # rank = (pp * dp + dp_idx) * tp + tp_idx
    assert layout.coord(13) == Coord(pp=1, dp=0, tp=1)  # (1*3 + 0)*4 + 1
    assert layout.coord(11) == Coord(pp=0, dp=2, tp=3)
    assert layout.rank(Coord(pp=1, dp=2, tp=3)) == 23
    assert layout.shape() == (2, 3, 1, 4)  # AXES order, slowest first
    assert AXES == ("pp", "dp", "cp", "tp")
    assert layout.size("tp") == 4 and layout.size("dp") == 3 and layout.size("pp") == 2


def test_cp_sits_between_tp_and_dp() -> None:
    """Context parallelism's ranks are next to each other after tp's (Megatron's tp-cp-dp-pp
    order): rank = ((pp * dp + dp_idx) * cp + cp_idx) * tp + tp_idx."""
    layout = Layout(dp=2, pp=2, tp=2, cp=2)
    assert layout.world_size == 16
    assert layout.coord(6) == Coord(pp=0, dp=1, tp=0, cp=1)  # ((0*2 + 1)*2 + 1)*2 + 0
    assert layout.coord(13) == Coord(pp=1, dp=1, tp=1, cp=0)
    assert all(layout.rank(layout.coord(r)) == r for r in range(16))
    assert layout.axis_ranks("cp", 5) == [5, 7]
    assert layout.axis_ranks("dp", 5) == [1, 5]
    assert layout.replica_ranks(5) == [1, 3, 5, 7]  # dp x cp: who shares the gradients
    assert layout.describe() == "dp=2 pp=2 tp=2 cp=2 (world 16)"
    with pytest.raises(ConfigError, match=r"dp\*pp\*tp\*cp = 2\*2\*2\*2 = 16"):
        layout.check_world(8)


def test_axis_ranks_concrete() -> None:
    layout = Layout(dp=2, pp=2, tp=2)
    assert layout.axis_ranks("tp", 5) == [4, 5]
    assert layout.axis_ranks("dp", 5) == [5, 7]
    assert layout.axis_ranks("pp", 5) == [1, 5]
    assert layout.axis_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.axis_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.axis_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(("dp", "pp", "tp"), LAYOUTS)
@pytest.mark.parametrize("axis", AXES)
def test_axis_groups_partition_the_world(dp: int, pp: int, tp: int, axis: str) -> None:
    layout = Layout(dp=dp, pp=pp, tp=tp)
    groups = layout.axis_groups(axis)
    size = layout.size(axis)
    assert len(groups) == layout.world_size // size
    assert all(len(g) == size for g in groups)
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(layout.world_size))  # disjoint and covering
    # Ordered by lowest rank, and identical whichever rank computes it (pure function).
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)
    assert Layout(dp=dp, pp=pp, tp=tp).axis_groups(axis) == groups
    others = [a for a in AXES if a != axis]
    for r in range(layout.world_size):
        mine = layout.axis_ranks(axis, r)
        assert mine in groups
        assert r in mine
        c = layout.coord(r)
        # Members differ from r only along `axis`, listed in axis order 0..size-1.
        member_coords = [layout.coord(m) for m in mine]
        assert [mc.get(axis) for mc in member_coords] == list(range(size))
        for mc in member_coords:
            assert all(mc.get(a) == c.get(a) for a in others)


def test_check_world_names_the_numbers() -> None:
    layout = Layout(dp=2, pp=2, tp=2)
    layout.check_world(8)
    with pytest.raises(ConfigError) as e:
        layout.check_world(6)
    assert str(e.value) == "world size 6 != dp*pp*tp = 2*2*2 = 8"


def test_describe() -> None:
    assert Layout(dp=3, pp=2, tp=4).describe() == "dp=3 pp=2 tp=4 (world 24)"


@pytest.mark.parametrize("axis", ["dp", "pp", "tp"])
@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", None])
def test_invalid_sizes_name_the_axis(axis: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{axis} must be a positive integer, got {bad!r}$"):
        Layout(**{axis: bad})


def test_defaults_are_single_process() -> None:
    layout = Layout()
    assert (layout.dp, layout.pp, layout.tp, layout.world_size) == (1, 1, 1, 1)


@pytest.mark.parametrize("rank", [-1, 8, 100])
def test_rank_out_of_range(rank: int) -> None:
    layout = Layout(dp=2, pp=2, tp=2)
    with pytest.raises(ConfigError, match=rf"rank {rank} out of range for world size 8"):
        layout.coord(rank)
    with pytest.raises(ConfigError, match=rf"rank {rank} out of range"):
        layout.axis_ranks("dp", rank)


@pytest.mark.parametrize(
    ("coord", "message"),
    [
        (Coord(pp=2, dp=0, tp=0), "pp coordinate 2 out of range for pp=2"),
        (Coord(pp=0, dp=-1, tp=0), "dp coordinate -1 out of range for dp=2"),
        (Coord(pp=0, dp=0, tp=3), "tp coordinate 3 out of range for tp=3"),
    ],
)
def test_coordinate_out_of_range(coord: Coord, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Layout(dp=2, pp=2, tp=3).rank(coord)


def test_layout_is_immutable() -> None:
    layout = Layout(dp=2)
    with pytest.raises(AttributeError):
        layout.dp = 4  # type: ignore[misc]


def test_bool_is_not_an_axis_size() -> None:
    with pytest.raises(ConfigError, match="dp must be a positive integer, got True"):
        Layout(dp=True)
