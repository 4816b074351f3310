"""`plait lessons --only` merges into its output folder: lessons.md and lessons.json keep the
lessons not re-run, in the course's order, and are replaced whole or not at all. Pure: the
sections are built here, no lesson runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from plait.cli import main
from plait.lessons.runner import registry
from plait.lessons.section import Row, Section
from plait.lessons.writeup import write_report

ORDER = list(registry())


def _section(name: str, measured: float, out: Path) -> Section:
    return Section(
        name=name,
        title=f"{name} title",
        intro=f"What {name} teaches.",
        rows=[Row(f"{name} bytes", "4Ψ", 100, measured, exact=True)],
        figures=[out / f"{name}-bytes.png"],
        notes=[f"{name} note"],
        raw={"case": {"steps": 2}},
    )


def _json(out: Path) -> dict:
    return json.loads((out / "lessons.json").read_text())


def test_only_keeps_the_lessons_not_rerun_in_the_courses_order(tmp_path):
    write_report([_section("tp", 100, tmp_path)], tmp_path, quick=True, order=ORDER)
    write_report([_section(n, 100, tmp_path) for n in ("zero", "dp")], tmp_path, True, ORDER)
    assert [s["name"] for s in _json(tmp_path)["sections"]] == ["dp", "tp", "zero"]
    md = (tmp_path / "lessons.md").read_text()
    assert [md.index(f"## {n} title") for n in ("dp", "tp", "zero")] == sorted(
        md.index(f"## {n} title") for n in ("dp", "tp", "zero")
    )
    assert "What tp teaches." in md and "(tp-bytes.png)" in md and "- tp note" in md
    assert "`plait lessons --quick` on this machine" in md


def test_a_rerun_lesson_replaces_only_its_own_section(tmp_path):
    write_report([_section(n, 100, tmp_path) for n in ORDER], tmp_path, True, ORDER)
    before = _json(tmp_path)["sections"]
    write_report([_section("dp", 90, tmp_path)], tmp_path, quick=False, order=ORDER)
    after = _json(tmp_path)["sections"]
    assert [s["name"] for s in after] == ORDER
    assert after[0]["rows"][0]["measured"] == 90 and after[0]["quick"] is False
    assert after[1:] == before[1:]
    md = (tmp_path / "lessons.md").read_text()
    assert md.count("| dp bytes |") == 1 and "| 90 B | 0.900 |" in md
    assert "`plait lessons` and `plait lessons --quick` (each section's" in md


def test_a_file_written_before_merging_is_kept(tmp_path):
    """lessons.json from before: no intro, `quick` only at the top, figures by any path."""
    old = _section("zero", 100, tmp_path).as_dict()
    del old["intro"]
    old["figures"] = ["elsewhere/docs/lessons/zero-bytes.png"]
    (tmp_path / "lessons.json").write_text(json.dumps({"quick": True, "sections": [old]}))
    write_report([_section("dp", 100, tmp_path)], tmp_path, quick=True, order=ORDER)
    assert [s["name"] for s in _json(tmp_path)["sections"]] == ["dp", "zero"]
    assert "![zero-bytes](zero-bytes.png)" in (tmp_path / "lessons.md").read_text()


def test_a_failed_write_leaves_the_old_report_whole(tmp_path, monkeypatch):
    write_report([_section("dp", 100, tmp_path)], tmp_path, quick=True, order=ORDER)
    old = {p.name: p.read_text() for p in tmp_path.iterdir()}

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError):
        write_report([_section("tp", 100, tmp_path)], tmp_path, quick=True, order=ORDER)
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == old  # no temporary left


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{not json", "JSONDecodeError"),
        (b"\xff\xfe\x00binary", "UnicodeDecodeError"),
        (b'{"quick": true}', "KeyError"),
        (b'{"sections": [{"name": "dp"}]}', "KeyError"),
        (b"[1, 2]", "TypeError"),
    ],
)
def test_an_unreadable_report_is_refused_before_any_lesson_runs(tmp_path, capsys, content, why):
    (tmp_path / "lessons.json").write_bytes(content)
    assert main(["lessons", "--only", "dp", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{str(tmp_path / 'lessons.json')!r} cannot be read to keep its lessons ({why}" in err
    assert "move it away or give another --out" in err
    assert (tmp_path / "lessons.json").read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lessons.json"]


def test_the_docs_report_is_rebuilt_whole_from_its_json(tmp_path):
    """docs/lessons/lessons.json holds all a kept section needs: its lessons.md follows."""
    docs = Path(__file__).resolve().parents[1] / "docs" / "lessons"
    (tmp_path / "lessons.json").write_text((docs / "lessons.json").read_text())
    write_report([], tmp_path, quick=True, order=ORDER)
    assert (tmp_path / "lessons.md").read_text() == (docs / "lessons.md").read_text()
