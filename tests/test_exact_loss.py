"""A loss that is exact in every layout (issue 21): on packed, masked, variable-length rows
(tests/packed_rows.py: random example lengths, prompts and pads IGNORE, some rows without a
target), every layout of a world of 2 gives the single process's loss and gradient norm
every step, its final parameters and its validation loss (fp32, rtol 1e-5): data parallelism
with accumulation, tensor + sequence parallelism, every pipeline schedule, 2BW (against its
delayed rule), ZeRO 1-3 with CPU offload and naive data parallelism; and data parallelism
with accumulation on a prepared Alpaca examples folder, as `plait train` loads it. The old
per-micro-batch mean would differ on this data (test_no_cross_talk.py measures by how much).
The layouts attend packed rows by document (--packed-attention auto on CPU; the mask where
dropout is on), the reference through the dense mask: so every layout here, and selective and
full recomputation without dropout, also shows per-document attention equal to the mask."""

from __future__ import annotations

import numpy as np
import pytest

from exact_loss import exact_parity
from instruct_data import LLAMA_TEMPLATE, tokenizer_folder, write_jsonl
from plait.data.instruct import InstructJob, prepare_examples


def _id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


CASES = [
    dict(dp=2, micro=1, accum=2),
    dict(dp=2, micro=1, accum=2, dp_mode="naive"),
    dict(dp=2, micro=1, accum=2, zero=1),
    dict(dp=2, micro=1, accum=2, zero=2, preset="tiny-llama"),
    dict(dp=2, micro=1, accum=2, zero=3, offload="cpu"),
    dict(tp=2, sequence_parallel=True, preset="tiny-llama", accum=2),
    dict(tp=2, sequence_parallel=True, accum=2, dropout=0.1, recompute="selective"),
    dict(pp=2, schedule="gpipe", micro=1, accum=4),
    dict(pp=2, schedule="1f1b", micro=1, accum=4, preset="tiny-llama"),
    dict(pp=2, schedule="interleaved", virtual_stages=2, n_layers=4, micro=1, accum=4),
    dict(pp=2, schedule="zb-h1", micro=1, accum=4, recompute="full", dropout=0.1),
    dict(tp=2, sequence_parallel=True, preset="tiny-llama", recompute="selective"),
    dict(pp=2, schedule="1f1b", micro=1, accum=4, recompute="full", preset="tiny-llama"),
    dict(pp=2, schedule="2bw", micro=1, accum=4),
]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_world2_layouts_give_the_single_process_loss(world2, case):
    out = world2.run(exact_parity, **case)
    assert out[0] == out[1]  # every rank reports the same global loss


def test_dp2_on_prepared_alpaca_examples(world2, tmp_path):
    """The trainer's own loading of an examples folder (build/corpus.py load_corpus): packed rows of
    Alpaca examples, prompts IGNORE, at dp2 with accumulation equal one process."""
    rng = np.random.default_rng(2)
    words = ["fox", "dog", "jumps", "over", "the", "lazy", "quick", "brown", "numbers"]
    rows = [
        {"instruction": " ".join(rng.choice(words, rng.integers(1, 4))), "input": "",
         "output": " ".join(rng.choice(words, rng.integers(1, 12)))}
        for _ in range(80)
    ]  # fmt: skip
    tok = tokenizer_folder(tmp_path / "tok", LLAMA_TEMPLATE)
    data = write_jsonl(tmp_path / "a.jsonl", rows)
    prepare_examples(InstructJob(str(data), tmp_path / "sft", "alpaca", str(tok)))
    case = dict(dp=2, micro=1, accum=2, preset="tiny-llama", examples=str(tmp_path / "sft"))
    out = world2.run(exact_parity, **case)
    assert out[0] == out[1]
