"""A non-finite loss or gradient norm: `--nan-policy stop` ends the run in one line, exit 1,
the last good checkpoint kept; `--nan-policy skip` leaves the parameters as they were and
counts the step. In process: a world of one runs its worker in the test's process (no spawn),
about a second a run. A learning rate of 1e30 makes step 1's loss NaN.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr
from pathlib import Path

import torch

from plait.checkpoint import inspect
from plait.cli import main

RUN = [
    "train", "--model", "tiny-gpt", "--dp", "1", "--steps", "4", "--seq-len", "32",
    "--global-batch", "2", "--micro-batch", "1", "--eval-batches", "1", "--eval-every", "0",
    "--max-bytes", "200000", "--no-progress", "--lr", "1e30", "--warmup-steps", "0",
    "--save-every", "1",
]  # fmt: skip


def _train(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err):
        code = main([*RUN, *args])
    return code, err.getvalue()


def test_stop_is_one_line_exit_1_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    code, err = _train(["--out", str(tmp_path)])
    assert code == 1
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert errors == [
        "plait: error: step 1: non-finite loss on rank 0 (loss nan, gradient norm nan); the "
        "run stopped (--nan-policy stop) and its last checkpoint is kept: lower --lr, or "
        "--nan-policy skip to skip such steps"
    ]
    assert "Traceback" not in err
    kept = tmp_path / "checkpoints"
    assert [p.name for p in kept.iterdir()] == ["step-1"]  # no save of the broken state
    model = inspect.load_model(kept / "step-1")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_leaves_the_parameters_and_counts_the_steps(tmp_path: Path) -> None:
    code, err = _train(["--out", str(tmp_path), "--nan-policy", "skip"])
    assert code == 0, err
    assert "skipped steps" in err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["skipped_steps"] == 3  # steps 1, 2 and 3
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step_skipped"] for r in rows] == [False, True, True, True]
    states = [inspect.load_model(tmp_path / "checkpoints" / f"step-{n}") for n in (2, 3, 4)]
    for later in states[1:]:  # skipped steps: every parameter exactly as it was
        for a, b in zip(states[0].parameters(), later.parameters(), strict=True):
            assert torch.equal(a, b)


def test_nan_policy_values(tmp_path: Path) -> None:
    code, err = _train(["--out", str(tmp_path), "--nan-policy", "maybe"])
    assert code == 2
    assert err == "plait: error: nan_policy must be one of stop, skip; got 'maybe'\n"
    code, err = _train(["--out", str(tmp_path), "--nan-policy", "skip", "--dp", "1", "--pp",
                        "2", "--schedule", "2bw", "--microbatches", "2"])  # fmt: skip
    assert code == 2
    assert "--nan-policy skip does not combine with --schedule 2bw" in err
    assert not (tmp_path / "checkpoints").exists()


def test_every_rank_stops_at_the_same_step_through_the_launcher(tmp_path: Path) -> None:
    """dp2, spawned: the loss and the norm are global, so both ranks refuse step 1 (no rank
    waits in a collective for the other); the launcher prints the reason alone, exit 1, and
    does not restart a diverged run."""
    code, err = _train(["--out", str(tmp_path), "--dp", "2", "--comm-timeout", "60",
                        "--max-restarts", "1"])  # fmt: skip
    assert code == 1
    assert "plait: error: step 1: non-finite loss on rank " in err
    assert "restart" not in err and "Traceback" not in err
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-1"]
