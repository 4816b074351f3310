"""ZeRO on four ranks: uneven parity, and memory and communication at the paper's figures.

Memory: every rank's persistent model-state bytes, as the tracker measured them from the
allocated tensors, equal the formula with the padded parameter count Ψp exactly, and the
formula with the true Ψ within 2% plus the padding. Communication: logical bytes per step,
from comm.py's accounting, equal DP all-reduce Ψ, ZeRO-1/2 reduce-scatter Ψ + all-gather
Ψ, ZeRO-3 all-gather 2Ψ + reduce-scatter Ψ (times the micro-batches where a stage reduces
or gathers per micro-batch), in the dtype the precision uses.
"""

from __future__ import annotations

import pytest
import torch

from plait.estimate.formulas import zero_comm_elements, zero_model_state_bytes
from plait.mixed_precision import parse_precision
from reference import corpus_for
from zero_helpers import parity, train, zero_config

N = 4
BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def test_stages_match_stage0_on_four_ranks_uneven(world4):
    results = world4.run(
        parity, [1, 2, 3], exact=False, clip=1.0, dp=N, accum=2, d_model=45, n_heads=3
    )
    assert all(results[0][s]["padding"] > 0 for s in (1, 2, 3))
    for stage in (1, 2, 3):  # the four ranks' shards partition the parameters exactly
        assert sum(r[stage]["elements"] for r in results) == results[0]["numel"]


def _measure(precision: str, accum: int) -> dict:
    """One short run per stage through the Trainer: persistent bytes by category, peaks,
    last step's traffic."""
    cfg = zero_config(dp=N, accum=accum, steps=2, n_layers=4, d_model=45, n_heads=3)
    corpus = corpus_for(cfg)
    out = {}
    for stage in (0, 1, 2, 3):
        got, trainer = train(cfg, corpus, stage, precision=precision)
        engine = trainer.engine
        mem = engine.memory
        cats = ("parameters", "gradients", "master_weights", "optimizer_states")
        groups = engine.groups
        out[stage] = {
            "persistent": {c: mem.persistent(c) for c in cats},
            "model_states": mem.model_state_bytes(),
            "psi": sum(g.numel for g in groups),
            "psi_padded": sum(g.padded for g in groups),
            "peak": {
                c: got.memory[-1]["peak"]["device"][c] for c in ("parameters", "comm_buffers")
            },
            "largest_group": max(g.padded for g in groups),
            "group_sizes": [g.padded for g in groups],
            "root_group": groups[-1].padded,
            "traffic": {
                (r["op"], r["dtype"]): r["elements"]
                for r in got.stats[-1]
                if r["tag"] in ("grad", "params")
            },
        }
        trainer.close()
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_model_states_and_traffic_equal_the_formulas(world4, precision):
    policy = parse_precision(precision)
    p_bytes, g_bytes = BYTES[policy.param_dtype], BYTES[policy.reduce_dtype]
    k_bytes = 8 + (4 if policy.needs_master else 0)
    dtype = str(policy.param_dtype).removeprefix("torch.")
    runs = {accum: world4.run(_measure, precision, accum) for accum in (1, 2)}
    for accum, results in runs.items():
        for stage in (0, 1, 2, 3):
            per_rank = [r[stage] for r in results]
            r = per_rank[0]
            psi, psi_p = r["psi"], r["psi_padded"]
            assert all(x["persistent"] == r["persistent"] for x in per_rank)  # balanced
            # Exact: the formula with the padded count (stage 0 pads nothing).
            exact = zero_model_state_bytes(stage, psi_p, N, p_bytes, g_bytes, k_bytes)
            assert r["model_states"] == exact, (stage, r["persistent"])
            # The paper's formula with the true count: within 2% plus the padding's bytes.
            theory = zero_model_state_bytes(stage, psi, N, p_bytes, g_bytes, k_bytes)
            padding = (psi_p - psi) * (p_bytes + g_bytes + k_bytes)
            assert abs(r["model_states"] - theory) <= 0.02 * theory + padding
            if not policy.needs_master:
                assert r["persistent"]["master_weights"] == 0  # fp32: parameters are masters
            # Traffic per step: the formula, in the compute (= reduction) dtype.
            expect = zero_comm_elements(stage, psi_p, accum)
            got = {op: n for (op, dt), n in r["traffic"].items()}
            assert got == expect, (stage, accum, r["traffic"])
            assert {dt for (_, dt) in r["traffic"]} == {dtype}
    _check_peaks(runs[2][0])


def _check_peaks(r: dict) -> None:
    """Transient buffers stay bounded (bytes per element from the persistent figures)."""
    s2, s3 = r[2], r[3]
    grad_bytes = s2["persistent"]["gradients"] * N // s2["psi_padded"]
    # Stage 2: at most max_inflight + 1 = 3 full gradient buckets alive at once.
    assert 0 < s2["peak"]["comm_buffers"] <= 3 * grad_bytes * s2["largest_group"]
    # Stage 3: the shards + the root + at most two blocks gathered (current, prefetched),
    # below the unsharded parameters (four blocks and the root).
    shards = s3["persistent"]["parameters"]
    p_bytes = shards * N // s3["psi_padded"]
    block = max(g for g in s3["group_sizes"][:-1])
    bound = shards + p_bytes * (s3["root_group"] + 2 * block)
    assert shards < s3["peak"]["parameters"] <= bound < shards + p_bytes * s3["psi_padded"]
