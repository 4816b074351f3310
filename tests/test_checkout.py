"""The suite does not depend on the folder it runs in (conftest.py): every test runs in a
stand-in clone after `make train`, never in the checkout, and no test leaves a file in the
checkout. These tests show both hold, and that the first is the condition that made
`make test` fail after `make train` (a test writing the default `runs/default`)."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import ROOT, checkout_files, finished_run
from plait.cli import main


def test_the_suite_runs_in_a_clone_after_make_train(cwd_after_make_train: Path) -> None:
    here = Path.cwd().resolve()
    assert here == cwd_after_make_train.resolve() and ROOT not in (here, *here.parents)
    assert sorted(p.name for p in (here / "runs" / "default").iterdir()) == [
        "checkpoints", "config.json", "metrics.jsonl", "summary.json"
    ]  # fmt: skip


def test_a_train_without_its_own_out_is_refused_there(capsys, monkeypatch) -> None:
    """What test_cli's fp16 test did before it named its --out: here it fails every time."""
    monkeypatch.setattr("plait.cli.train.launch", lambda cfg: None)
    assert main(["train", "--seq-len", "32"]) == 2
    assert "output folder 'runs/default' already holds a run" in capsys.readouterr().err


def test_the_listing_sees_a_new_file(tmp_path: Path) -> None:
    """checkout_files (what the per-module check compares) finds a file added anywhere but
    in the caches it skips."""
    root = tmp_path / "clone"
    (root / "src").mkdir(parents=True)
    (root / ".venv").mkdir()
    before = checkout_files(root)
    (root / ".venv" / "x").write_text("")
    (root / "src" / "__pycache__").mkdir()
    (root / "src" / "__pycache__" / "y.pyc").write_text("")
    assert checkout_files(root) == before
    finished_run(root / "runs" / "default")
    assert checkout_files(root) - before == {
        os.path.join("runs", "default", name) for name in
        ("config.json", "metrics.jsonl", "summary.json")
    }  # fmt: skip
