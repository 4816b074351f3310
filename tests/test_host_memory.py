"""Host memory before workers start (issue 23, item 8): the node's ranks' host bytes from the
estimate against the host's available memory, refused in one line naming both; `plait
estimate` says the node's host total. Pure logic: the available figure is injected."""

from __future__ import annotations

import json

import pytest

from memory_runs import Case
from plait.cli import main
from plait.device import host_available_bytes
from plait.errors import ConfigError
from plait.estimate import estimate
from plait.estimate.host import check_host_memory, node_host_bytes
from plait.estimate.table import gib
from plait.launcher_env import launched


def _cfg(**par):
    return Case("host", parallel=par, accum=2).config()


def test_node_total_is_each_ranks_stage_host_total():
    """pp2 x dp2: two ranks of each stage, each its stage's host total; ZeRO CPU offload's
    moments and masters add to the saved activations."""
    cfg = _cfg(pp=2, dp=2, schedule="1f1b", offload_activations="cpu", zero=1, offload="cpu")
    est = estimate(cfg)
    per_stage = [r.total("host") for r in est.ranks]
    assert all(
        r.line("activations").host > 0 and r.line("optimizer_states").host > 0 for r in est.ranks
    )
    assert node_host_bytes(est, cfg.parallel.layout, range(4)) == 2 * sum(per_stage)
    assert node_host_bytes(est, cfg.parallel.layout, range(2, 4)) == 2 * per_stage[1]


def test_refusal_names_both_figures():
    cfg = _cfg(dp=2, offload_activations="cpu")
    est = estimate(cfg)
    need = 2 * est.ranks[0].total("host")
    check_host_memory(est, cfg.parallel.layout, range(2), need)  # exactly enough: runs
    with pytest.raises(ConfigError) as e:
        check_host_memory(est, cfg.parallel.layout, range(2), need - 1)
    msg = str(e.value)
    assert f"the 2 ranks on this node would hold {need / 2**30:,.2f} GiB ({need:,} B)" in msg
    assert f"({need - 1:,} B) this host has available" in msg
    assert "saved activations (--offload-activations cpu)" in msg and "\n" not in msg


def test_train_refuses_before_workers(capsys, monkeypatch):
    """`plait train --offload-activations cpu` on a host with 1 MiB available: one line,
    exit 2 (no worker starts: the launcher is never reached)."""
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setattr("plait.cli.train.host_available_bytes", lambda: 2**20)
    monkeypatch.setattr("plait.cli.train.launch", lambda cfg: pytest.fail("launched"))
    args = ["train", "--dp", "2", "--offload-activations", "cpu", "--zero", "1", "--offload"]
    assert main([*args, "cpu"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("plait: error: host memory: the 2 ranks on this node")
        and err.count("\n") == 1
    ), err
    assert "(1,048,576 B) this host has available" in err
    assert "saved activations (--offload-activations cpu) and optimizer states" in err


def test_no_host_bytes_nothing_checked(monkeypatch):
    """Without any offload nothing is estimated or compared (available 0 still starts)."""
    monkeypatch.setattr("plait.cli.train.host_available_bytes", lambda: 0)
    monkeypatch.setattr("plait.cli.train.launch", lambda cfg: None)
    monkeypatch.setattr("plait.cli.train.prepare_out", lambda *a: None)
    assert main(["train", "--dp", "2"]) == 0


def test_node_ranks_under_torchrun():
    """Node by node: the second node of 2 x 4 ranks holds ranks 4-7."""
    env = {"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert launched(env).node_ranks() == range(4, 8)


def test_estimate_says_the_host_total(capsys, monkeypatch):
    """The node's total in the table's words, and a warning where it exceeds the host's
    available memory (the JSON's per-rank host total times the 2 ranks)."""
    monkeypatch.setattr("plait.cli.estimate.host_available_bytes", lambda: 2**20)
    args = ["estimate", "--dp", "2", "--offload-activations", "cpu"]
    assert main([*args, "--json"]) == 0
    need = 2 * json.loads(capsys.readouterr().out)["ranks"][0]["total"]["host"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert f"Host memory, 2 ranks on one machine: {gib(need)}" in " ".join(out.split())
    assert f"the host total {gib(need)} exceeds the 0.001 GiB this host has available" in err


def test_available_is_a_plausible_figure():
    """MemAvailable (or the free pages) is positive and no more than the machine's RAM."""
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < host_available_bytes() <= ram
