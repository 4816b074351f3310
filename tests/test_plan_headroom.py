"""`plait plan --memory-headroom`: a layout fits only when its estimate plus the headroom
fits the device; the table says what each layout leaves free, a refused layout by how much it
misses with the headroom counted, and a headroom that leaves no device is one line, exit 2,
before the planner runs. Pure: no process starts; small-gpt on the cpu profile (seconds)."""

from __future__ import annotations

import json

import pytest

import plait.cli.plan as plan_command
from plait.cli import main
from plait.domain import Unparsed
from plait.errors import ConfigError
from plait.estimate.table import gib
from plait.models.presets import get_preset
from plait.plan.enumerate import Request
from plait.plan.hardware import load_hardware
from plait.plan.headroom import DEFAULT, HEADROOM, Size, headroom_bytes
from plait.plan.ranking import plan_table
from plait.plan.search import plan

ARGV = ["plan", "--model", "small-gpt", "--gpus", "4", "--global-batch", "16"]
ARGV += ["--seq-len", "128", "--hardware", "cpu", "--top", "3"]


def _request() -> Request:
    return Request(get_preset("small-gpt"), "small-gpt", 4, 4, 16, 128, "fp32", 8, None, ())


@pytest.fixture(scope="module")
def edge() -> int:
    """A device exactly as large as the leanest layout's estimate: that layout fits with no
    headroom, and nothing fits with the default one."""
    out = plan(_request(), load_hardware("cpu"), 1024, top=3)  # 1 KiB: every layout dropped
    return out.dropped[0].need  # cheapest need first


def test_the_default_is_ten_percent_and_the_flag_parses_shares_and_sizes():
    assert DEFAULT == "10%" and HEADROOM(DEFAULT) == 10.0 and HEADROOM("7.5") == 7.5
    assert headroom_bytes(HEADROOM("10%"), 80 * 2**30) == 8 * 2**30
    size = HEADROOM("6GiB")
    assert isinstance(size, Size) and headroom_bytes(size, 80 * 2**30) == 6 * 2**30
    assert isinstance(HEADROOM("lots"), Unparsed) and isinstance(HEADROOM("0GiB"), Unparsed)
    assert HEADROOM.problem(HEADROOM("0")) is None and HEADROOM.problem(100.0) is not None


def test_a_layout_at_the_edge_fits_without_headroom_only(edge):
    memory = need = edge
    bare = plan(_request(), load_hardware("cpu"), memory, top=3)
    assert bare.ranked and bare.ranked[0].memory == need
    kept = headroom_bytes(HEADROOM(DEFAULT), memory)
    refused = plan(_request(), load_hardware("cpu"), memory, top=3, headroom=kept)
    assert not refused.ranked and refused.budget == memory - kept
    assert refused.dropped[0].need == need  # the same estimate, refused for the headroom


def test_the_command_refuses_it_naming_the_shortfall_with_the_headroom(edge, capsys):
    memory = need = edge
    argv = [*ARGV, "--gpu-memory", f"{memory}B"]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    kept = int(memory * 0.10)
    budget = memory - kept
    assert "nothing fits" in err
    assert f"fits in {gib(budget)} ({gib(memory)} less {gib(kept)} headroom)" in err
    assert f"needs {gib(need)} ({gib(need - budget)} more than the {gib(budget)} usable;" in err
    assert main([*argv, "--memory-headroom", "0"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"{gib(need)} │ - (0.0%) │" in out  # the whole device used: nothing left free


def test_the_free_column_is_device_less_estimate(edge):
    memory = edge * 5 // 4  # the leanest layouts fit, with little to spare beyond 10%
    out = plan(_request(), load_hardware("cpu"), memory, top=3, headroom=memory // 10)
    table = plan_table(out, 3)
    names = [c.header for c in table.columns]
    cells = dict(zip(names, (list(c._cells) for c in table.columns), strict=True))
    assert f"({gib(memory)} each, {gib(memory // 10)} kept free)" in str(table.title)
    assert len(cells["free"]) == min(3, len(out.ranked)) > 0
    for r, used, left in zip(out.ranked[:3], cells["memory"], cells["free"], strict=True):
        spare = memory - r.memory
        assert spare >= memory // 10 and used == gib(r.memory)
        assert left == f"{gib(spare)} ({spare / memory:.1%})"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-5", "--memory-headroom must be a share of device memory in [0, 100)% (e.g. 10%) "
         "or a size (e.g. 6GiB), got -5.0"),
        ("100%", "--memory-headroom must be a share of device memory in [0, 100)% (e.g. 10%) "
         "or a size (e.g. 6GiB), got 100.0"),
        ("-2GiB", "--memory-headroom must be a share of device memory in [0, 100)% (e.g. 10%) "
         "or a size (e.g. 6GiB), got '-2GiB'"),
        ("6GiB", "--memory-headroom 6.000 GiB is not less than the device's 5.890 GiB: nothing "
         "could fit; give less, or a percentage"),
    ],
)  # fmt: skip
def test_bad_headroom_is_one_line_and_exit_2_before_planning(value, message, capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the planner ran")

    monkeypatch.setattr(plan_command, "plan", never)
    assert main([*ARGV, f"--memory-headroom={value}"]) == 2
    err = capsys.readouterr().err
    assert err == f"plait: error: {message}\n"


def test_a_size_as_large_as_the_device_is_refused():
    with pytest.raises(ConfigError, match=r"^--memory-headroom 2\.000 GiB is not less than"):
        headroom_bytes(Size(2 * 2**30), 2 * 2**30)


def test_estimate_keeps_the_same_headroom_under_device_memory(capsys):
    """`plait estimate --device-memory` refuses a rank whose estimate fits the device but not
    with the default headroom, naming it; `--memory-headroom 0` accepts it."""
    assert main(["estimate", "--json"]) == 0
    need = max(r["total"]["device"] for r in json.loads(capsys.readouterr().out)["ranks"])
    device = need / 2**30 * 1.05  # 5% spare: under the default 10%
    argv = ["estimate", "--json", "--device-memory", repr(device)]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    kept = int(int(device * 2**30) * 0.10) / 2**30
    assert f"more than --device-memory {device:g} GiB less --memory-headroom {kept:,.2f} GiB" in err
    assert main([*argv, "--memory-headroom", "0"]) == 0
    assert main([*argv, "--memory-headroom", "4%"]) == 0
