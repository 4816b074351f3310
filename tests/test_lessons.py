"""`plait lessons`: each lesson's cases run (quick, 2 steps) on a 2-rank world, and the
deterministic figures its section reports equal the formulas (bytes per op, model states,
simulated bubbles); bad requests exit 2 before anything runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from plait.cli import main
from plait.config import Config
from plait.lessons.measure import measure
from plait.lessons.runner import choose_procs, registry
from plait.lessons.section import Run
from plait.mesh import build_mesh


def _measure(cfg: Config) -> dict:
    return measure(cfg, build_mesh(cfg.parallel.layout, torch.device("cpu"), 60))


def _runs(world, lesson, out: Path) -> dict[str, Run]:
    runs = {}
    for case in lesson.cases(quick=True, procs=2):
        train = dataclasses.replace(case.cfg.train, steps=2, out=str(out / case.label))
        cfg = dataclasses.replace(case.cfg, train=train)
        runs[case.label] = Run(cfg, world.run(_measure, cfg))
    return runs


@pytest.mark.parametrize("name", ["dp", "pipeline", "zero", "precision", "offload"])
def test_each_lesson_reports_the_formulas_exactly(world2, tmp_path, name):
    lesson = registry()[name]
    section = lesson.section(_runs(world2, lesson, tmp_path / "runs"), tmp_path / "out")
    exact = [r for r in section.rows if r.exact]
    assert len(exact) >= 3
    for row in exact:
        assert row.measured == row.expected, row  # bytes, model states, simulated bubbles
    assert all(f.exists() and f.stat().st_size > 0 for f in section.figures)
    timed = [r for r in section.rows if not r.exact]
    assert timed and all(r.measured > 0 for r in timed)


def test_rank_zero_holds_what_naive_dp_adds(world2, tmp_path):
    lesson = registry()["dp"]
    section = lesson.section(_runs(world2, lesson, tmp_path / "runs"), tmp_path / "out")
    rows = {r.what: r for r in section.rows}
    assert rows["naive: optimizer states on rank 0"].measured > 0
    assert rows["naive: optimizer states on rank 1"].measured == 0


def test_bad_requests_exit_2_before_anything_runs(tmp_path, capsys):
    assert main(["lessons", "--only", "dp", "--only", "nope", "--out", str(tmp_path)]) == 2
    known = "dp, pipeline, zero, precision, offload"
    assert f"unknown lesson nope; known: {known}" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["lessons", "--out", str(tmp_path / "file" / "sub")]) == 2
    err = capsys.readouterr().err
    assert f"output folder {tmp_path / 'file' / 'sub'} cannot be written: Not a directory" in err
    assert not list(tmp_path.glob("**/lessons.md"))


def test_too_few_cores_says_so_and_runs_with_fewer_processes():
    said: list[str] = []
    assert choose_procs(2, said.append) == 2
    assert said == ["2 CPU cores: lessons run with 2 processes instead of 4"]
    assert choose_procs(1, said.append) == 2 and "sharing one core" in said[-1]
    assert choose_procs(8, said.append) == 4 and len(said) == 2
