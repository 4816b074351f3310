"""Shared fixtures: one gloo world per size per test module (start-up is the costly part),
and the folder every test runs in.

The suite never runs in the checkout: the session moves to a folder of its own that looks
like a fresh clone after `make train` (`runs/default` holds a finished run), so a test that
writes to a default path (`runs/default`, `lessons/`, `hardware.toml`) writes there, and one
that needs `runs/default` free fails every time, not only after `make train`. After each
module the checkout is listed again: a test that wrote into it (by an absolute path) fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import World
from plait.outdir import RUN_FILES

ROOT = Path(__file__).resolve().parents[1]
NOT_LISTED = frozenset({".git", ".venv", ".pytest_cache", ".ruff_cache", "__pycache__"})
"""What the checkout's listing skips: git's, the environment's and tools' caches."""


def checkout_files(root: Path = ROOT) -> set[str]:
    """Every file of the checkout (relative paths), caches and build metadata left out."""
    found = set()
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders
                         if d not in NOT_LISTED and not d.endswith(".egg-info")]  # fmt: skip
        found.update(os.path.relpath(os.path.join(folder, f), root) for f in files)
    return found


def finished_run(out: Path) -> Path:
    """What `make train` leaves in `out` (the files `plait train` refuses to mix with)."""
    (out / "checkpoints").mkdir(parents=True)
    for name in RUN_FILES:
        (out / name).write_text("{}\n")
    return out


@pytest.fixture(scope="session", autouse=True)
def cwd_after_make_train(tmp_path_factory) -> Path:
    """The session's working folder: a stand-in clone after `make train`."""
    folder = tmp_path_factory.mktemp("clone")
    finished_run(folder / "runs" / "default")
    before = os.getcwd()
    os.chdir(folder)
    yield folder
    os.chdir(before)


@pytest.fixture(scope="module", autouse=True)
def checkout_unchanged():
    """No test module leaves a file in the checkout."""
    before = checkout_files()
    yield
    added = sorted(checkout_files() - before)
    assert not added, f"tests wrote into the checkout {ROOT}: {added[:5]}"


@pytest.fixture(scope="module")
def world2():
    w = World(2)
    yield w
    w.close()


@pytest.fixture(scope="module")
def world4():
    w = World(4)
    yield w
    w.close()
