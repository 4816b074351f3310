"""`plait eval` in multi-rank layouts, its ranks on one harness world (tests/in_process.py:
the real command and each rank's real `eval_worker`, without process start-up per run):
data parallelism with ZeRO-3 splitting the rows unevenly (5 one-example rows over 2
replicas: the second runs a micro-batch without targets, or the first would wait on its
parameter gathers forever), tensor parallelism with sequence parallelism, and a two-stage
pipeline on packed rows give the single process's figures."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import in_process
from eval_cases import EXAMPLES, SEQ, evaluate, model_folder
from instruct_data import write_jsonl


@pytest.fixture(scope="module")
def argv(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("eval-world")
    folder = model_folder(root / "llama", "llama")
    rows = write_jsonl(root / "rows.jsonl", EXAMPLES)
    return ["--init-from", str(folder), "--data", str(rows), "--format", "alpaca", "--seq-len",
            str(SEQ)]  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "rows"),
    [
        (["--dp", "2", "--zero", "3"], ["--no-pack"]),
        (["--tp", "2", "--sequence-parallel"], []),
        (["--pp", "2"], []),
    ],
    ids=["dp2-zero3-padded", "tp2-sp-packed", "pp2-packed"],
)
def test_a_layout_gives_the_single_process_figures(world2, argv, layout, rows, capsys) -> None:
    one = evaluate([*argv, *rows], capsys)
    code, out, err = in_process.evaluate(world2, [*argv, *rows, *layout, "--micro-batch", "1",
                                                  "--device", "cpu", "--json"])  # fmt: skip
    assert code == 0, err[-3000:]
    many = json.loads(out)
    assert many["loss"] == pytest.approx(one["loss"], rel=1e-6)
    counts = ("target_tokens", "examples", "rows", "truncated", "dropped")
    assert [many[k] for k in counts] == [one[k] for k in counts]
    assert many["rows"] == (len(EXAMPLES) if rows else one["rows"]) and one["rows"] > 1
