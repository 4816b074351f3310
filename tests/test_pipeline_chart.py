"""Charts and traces from timing records, and the `plait schedule` entry point."""

from __future__ import annotations

import json
from fractions import Fraction as Fr

import pytest

from plait.cli.schedule import schedule_main
from plait.errors import ConfigError
from plait.schedule.chart import gantt_chart, trace_events, write_trace
from plait.schedule.schedules import interleaved, zb_h1
from plait.schedule.simulate import Costs, simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_gantt_chart_png(tmp_path):
    sim = simulate(interleaved(2, 4, 2), Costs(Fr(1, 2), Fr(1, 2), Fr(1, 2)))
    path = gantt_chart(sim.timings, tmp_path / "sub" / "chart.png", title="interleaved")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) < 100_000


def test_trace_is_well_formed(tmp_path):
    sim = simulate(zb_h1(3, 4))
    path = write_trace(sim.timings, tmp_path / "t.trace.json", us_per_unit=1000.0)
    trace = json.loads(path.read_text())
    assert trace == json.loads(json.dumps(trace_events(sim.timings, 1000.0)))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == sum(len(acts) for acts in sim.schedule.ranks)
    assert {e["pid"] for e in events} == {0, 1, 2}
    for e in events:
        assert e["dur"] >= 0 and e["ts"] >= 0 and e["tid"] in (0, 1)
        assert isinstance(e["name"], str) and e["cat"] in {"F", "B", "W", "STEP"} | {
            "SEND_F",
            "RECV_F",
            "SEND_B",
            "RECV_B",
        }
    assert max(e["ts"] + e["dur"] for e in events) == pytest.approx(float(sim.makespan) * 1000)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["rank 0", "rank 1", "rank 2"]


def test_schedule_main_prints_returns_and_writes(tmp_path, capsys):
    out = schedule_main(4, 8, "1f1b", 1, tmp_path)
    assert out["bubble_fraction"] == pytest.approx(3 / 11)
    assert out["predicted_bubble_fraction"] == pytest.approx(3 / 11)
    assert out["makespan"] == 33
    assert out["peak_in_flight"] == [4, 3, 2, 1]
    assert (tmp_path / "1f1b-p4-m8.png").read_bytes().startswith(PNG_MAGIC)
    assert json.loads((tmp_path / "1f1b-p4-m8.trace.json").read_text())["traceEvents"]
    text = capsys.readouterr().out.replace("\n", "")  # rich folds a long path at any width
    assert "0.2727" in text and "(p-1)/(m+p-1)" in text and "1f1b-p4-m8.png" in text


def test_schedule_main_compares_on_equal_work(capsys):
    """Unit costs scale chunks by 1/v and split zb-h1's backward 1 + 1: same work per rank."""
    il = schedule_main(4, 8, "interleaved", 2, None)
    zb = schedule_main(4, 8, "zb-h1", 1, None)
    bw = schedule_main(4, 8, "2bw", 1, None)
    assert il["bubble_fraction"] == pytest.approx(3 / 19)
    assert il["peak_in_flight_stages"] == [5.5, 4.5, 3.5, 2.5]
    assert zb["makespan"] == 27 and zb["bubble_fraction"] == pytest.approx(1 / 9)
    assert bw["weight_versions"] == [2, 2, 2, 2] and bw["steps"] == 2
    assert il["chart"] is None and "chunks = 5.5 stages" in capsys.readouterr().out


def test_schedule_main_bad_input():
    with pytest.raises(ConfigError, match="m a multiple of p, got m=6, p=4"):
        schedule_main(4, 6, "interleaved", 2, None)
    with pytest.raises(ConfigError, match="unknown schedule"):
        schedule_main(4, 8, "bogus", 1, None)
