"""The estimate against what runs measure (memory tracker by category), on every row of
docs/memory.md's table (tests/memory_table.py, the list benchmarks/bench_memory.py prints;
its LoRA rows run in test_lora_estimate.py, its 4-rank rows in test_zero_pipelines.py, both
with `check_layout`) and on layouts beyond it, in one 2-rank world: model states,
activations and the total within 2% in both directions.
The total is the tracker's peak, which falls at different moments of the step on different
layouts (forward end, a backward with buckets and gathered units alive): the estimate's
moments (estimate/peak.py) must find it, not only bound it. Packed instruction rows (an
examples folder): attended by document, or through one block-causal mask per micro-batch for
all layers (--packed-attention mask, dropout); per-token positions;
the estimate counts every position a target, the run only its targets (memory_runs.py
takes the difference out, so the rest must still agree)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harness import World
from instruct_data import LLAMA_TEMPLATE, tokenizer_folder, write_jsonl
from memory_runs import Case, compare, error, measure
from memory_table import TABLE, is_lora
from plait.config import Config
from plait.data.instruct import InstructJob, prepare_examples
from plait.estimate import estimate
from plait.estimate.rank_params import tp_partial_elements
from plait.plan.traffic import step_collectives
from plait.schedule.stages import StagePlan, rank_plans

# the table's 2-rank rows; its LoRA rows run in test_lora_estimate.py, its 4-rank rows in
# test_zero_pipelines.py's world (warm there: a fresh 4-rank world's first run costs seconds)
ROWS = [c for c in TABLE if c.world == 2 and not is_lora(c)]
# Beyond the table: offload with full recomputation (its peak moves into the backward), and
# dropout under SP with selective recomputation (the dropout keys of a sharded sequence).
MORE = [
    Case(
        "dp2 zero2 cpu-offload full-recompute",
        "small-llama",
        parallel={"dp": 2, "zero": 2, "offload": "cpu", "recompute": "full"},
    ),
    Case(
        "tp2 sp selective dropout",
        "small-llama",
        parallel={"tp": 2, "sequence_parallel": True, "recompute": "selective"},
        model={"dropout": 0.1},
    ),
    # The families (issue 31): Qwen3's head size apart from d_model / n_heads and its per-head
    # q/k norms, Qwen2's q/k/v biases, under tp2 with sequence parallelism.
    Case("tp2 sp qwen3", "tiny-qwen3", parallel={"tp": 2, "sequence_parallel": True}),
    Case("tp2 qwen2", "tiny-qwen2", parallel={"tp": 2}),
    # Gemma 2's four fp32 norms and soft-capped scores (the explicit path), and Mistral's
    # sliding window with a head size apart from d_model / n_heads.
    Case("tp2 sp gemma2", "tiny-gemma2", parallel={"tp": 2, "sequence_parallel": True}),
    Case("dp2 mistral", "tiny-mistral", parallel={"dp": 2}),
]
# Instruction data, attended by document (the default on CPU: no mask, no log-sum-exp), or
# through the mask (--packed-attention mask, and always under dropout): the mask saved once per
# micro-batch and chunk (fused, selective), none (explicit path, full recomputation), once per
# block on the host (activation offload); exact, but tp2+SP and full recomputation 32 bytes
# under as their text twins.
PACKED = [
    Case("dp2 packed", parallel={"dp": 2}, packed=True),
    Case("dp2 packed mask", parallel={"dp": 2, "packed_attention": "mask"}, packed=True),
    Case(
        "tp2 sp packed selective",
        "small-llama",
        parallel={"tp": 2, "sequence_parallel": True, "recompute": "selective"},
        packed=True,
    ),
    Case("dp2 packed offload", parallel={"dp": 2, "offload_activations": "cpu"}, packed=True),
    Case(
        "pp2 interleaved packed",
        "small-llama",
        parallel={"pp": 2, "schedule": "interleaved", "virtual_stages": 2},
        accum=4,
        packed=True,
    ),
    Case(
        "tp2 sp packed selective dropout",
        "small-llama",
        parallel={"tp": 2, "sequence_parallel": True, "recompute": "selective"},
        model={"dropout": 0.1},
        packed=True,
    ),
    Case(
        "dp2 packed dropout bf16",
        "small-llama",
        parallel={"dp": 2, "precision": "bf16"},
        model={"dropout": 0.1},
        packed=True,
    ),
]
LIMIT = 0.02  # every compared term: model states by category, activations, the total


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> str:
    """A prepared Alpaca examples folder (rows of 64 tokens: two or three examples each)."""
    tmp = tmp_path_factory.mktemp("sft")
    rng = np.random.default_rng(3)
    words = ["fox", "dog", "jumps", "over", "the", "lazy", "quick", "brown", "numbers"]
    rows = [
        {"instruction": " ".join(rng.choice(words, rng.integers(1, 3))), "input": "",
         "output": " ".join(rng.choice(words, rng.integers(1, 8)))}
        for _ in range(120)
    ]  # fmt: skip
    tok = tokenizer_folder(tmp / "tok", LLAMA_TEMPLATE)
    prepare_examples(InstructJob(str(write_jsonl(tmp / "a.jsonl", rows)), tmp / "sft",
                                 "alpaca", str(tok)))  # fmt: skip
    return str(tmp / "sft")


CASES = ROWS + MORE + PACKED


@pytest.mark.parametrize("layout", CASES, ids=[x.name for x in CASES])
def test_estimate_matches_measurement(world2, examples, tmp_path, layout):
    check_layout(world2, layout, str(tmp_path), examples if layout.packed else None)


def check_layout(world: World, layout: Case, tmp: str, examples: str | None = None) -> None:
    """Run `layout` in `world` and hold the estimate to every rank's meter and the plan's
    small collectives to its counts (`tmp`: an nvme layout's offload folder is under it)."""
    nvme = str(Path(tmp) / "nvme")  # where `measure` puts it
    est = estimate(layout.config(nvme, examples))
    results = world.run(measure, layout, tmp, examples)
    for measured in results:
        for term, pair in compare(est, measured).items():
            assert abs(error(pair)) <= LIMIT, (layout.name, measured["pp_rank"], term, pair)
        if layout.packed and "tp" not in layout.parallel:  # the mask once, targets out
            pair = compare(est, measured)["activations"]
            assert pair[0] == pair[1], (layout.name, measured["pp_rank"], pair)
    _check_collectives(layout.config(nvme), results)


STEP_TAGS = ("loss", "grad_norm", "tied_embedding", "tp-sp-grads")
PARTIAL = ("tp", "tp-sp-grads")


def _check_collectives(cfg: Config, results: list[dict]) -> None:
    """Each rank's small collectives are the ones `plait plan` prices for it. Under ZeRO >= 1
    with dp > 1 a rank sums only the partial pieces inside its shard, unevenly, where the
    plan prices the whole / dp (near for the bytes): there the calls are exact per rank and
    a stage's ranks' elements add up to the whole on every tp rank."""
    par = cfg.parallel
    sharded = cfg.memory.zero >= 1 and par.dp > 1
    summed: dict[int, int] = {}
    for measured in results:
        got, want = _small_collectives(measured), _planned_cfg(cfg, measured["pp_rank"])
        if sharded and PARTIAL in want:
            (calls, elements, width), (w_calls, _, w_width) = got.pop(PARTIAL), want.pop(PARTIAL)
            assert (calls, width) == (w_calls, w_width), (measured["pp_rank"], calls, width)
            summed[measured["pp_rank"]] = summed.get(measured["pp_rank"], 0) + elements
        assert got == want, (measured["pp_rank"], got, want)
    for pp_rank, elements in summed.items():
        whole = tp_partial_elements(cfg.model, _plans(cfg, pp_rank), par.sequence_parallel)
        assert elements == par.tp * whole, (pp_rank, elements, whole)


def _small_collectives(measured: dict) -> dict:
    """{(axis, tag): (calls, elements, bytes per element)} this rank counted in its step."""
    rows = [r for r in measured["comm"] if r["tag"] in STEP_TAGS]
    assert all(r["op"] == "all_reduce" for r in rows), rows
    return {(r["axis"], r["tag"]): (r["calls"], r["elements"], r["bytes"] // r["elements"])
            for r in rows}  # fmt: skip


def _planned(layout: Case, pp_rank: int) -> dict:
    """What `plait plan` prices for that rank (plan/traffic.py `step_collectives`)."""
    return _planned_cfg(layout.config(), pp_rank)


def _planned_cfg(cfg: Config, pp_rank: int) -> dict:
    return step_collectives(cfg, _plans(cfg, pp_rank))


def _plans(cfg: Config, pp_rank: int) -> list[StagePlan]:
    """The parts pipeline rank `pp_rank` runs."""
    par = cfg.parallel
    sizes = par.stage_layer_counts()
    return rank_plans(cfg.model.n_layers, par.pp, par.virtual_stages, pp_rank, sizes)
