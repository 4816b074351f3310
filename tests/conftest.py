"""Shared fixtures: one gloo world per size per test module (start-up is the costly part)."""

from __future__ import annotations

import pytest

from harness import World


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
