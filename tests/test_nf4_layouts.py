"""QLoRA (`--base-dtype nf4`) in every layout equals one process (fp32, rtol 1e-5): data
parallelism (ZeRO 0 and 2), tensor parallelism with sequence parallelism (each rank holding
its rows or columns of each weight as whole 64-blocks with the weight's nested scales and
offset), pipelines in every synchronous schedule (naive, GPipe, 1F1B, interleaved, ZB-H1,
whose W computes the adapters' gradients only), full recomputation and activation offload
(tests/nf4_parity.py). Each rank's parameters are the NF4 bytes of its share of the base plus
the unquantized rest, and its optimizer states are the adapters' alone."""

from __future__ import annotations

import pytest
import torch

from nf4_parity import assert_same_run, nf4_run
from plait.models.nf4.format import bits_per_weight

ONE = {}  # the single-process runs, by global batch and micro-batch (computed once each)


def one_process(micro: int, accum: int, steps: int = 4, **same) -> dict:
    key = (micro, accum, steps, tuple(sorted(same.items())))
    if key not in ONE:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            ONE[key] = nf4_run(steps, micro=micro, accum=accum, **same)
        finally:
            torch.set_num_threads(threads)
    return ONE[key]


def _id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


DP2 = [dict(dp=2, accum=2), dict(dp=2, accum=1, zero=2)]


@pytest.mark.parametrize("case", DP2, ids=_id)
def test_data_parallel_nf4_equals_one_process(world2, case):
    out = world2.run(nf4_run, **case)
    want = one_process(micro=2, accum=case["accum"] * 2)
    for rank in out:
        assert_same_run(rank, want)
        assert rank["params"] == want["params"]  # the whole NF4 base on every replica


def test_tensor_parallel_nf4_equals_one_process(world2):
    out = world2.run(nf4_run, tp=2, sequence_parallel=True, accum=2)
    want = one_process(micro=2, accum=2)
    for rank in out:
        assert_same_run(rank, want)
    # each rank holds half of every quantized weight (its codes and absmax codes; the small
    # nested scales and offset of the whole weight ride along): about half the NF4 bytes
    per_rank = [r["params"] for r in out]
    assert per_rank[0] == per_rank[1] < 0.6 * want["params"]


PP2 = [
    dict(schedule="naive", accum=2),
    dict(schedule="gpipe", accum=4),
    dict(schedule="1f1b", accum=3),
    dict(schedule="interleaved", virtual_stages=2, n_layers=4, accum=4),
    dict(schedule="zb-h1", accum=4),
]


@pytest.mark.parametrize("case", PP2, ids=_id)
def test_pipelined_nf4_equals_one_process(world2, case):
    out = world2.run(nf4_run, pp=2, **case)
    extra = {"n_layers": case["n_layers"]} if "n_layers" in case else {}
    want = one_process(micro=2, accum=case["accum"], **extra)
    for rank in out:
        assert_same_run(rank, want)
    held = {n for rank in out for n in rank["adapters"]}
    assert held == set(want["adapters"])  # the stages hold all the adapters between them


def test_zero3_shards_the_packed_bytes_and_gathers_them_per_block(world2):
    """ZeRO-3: each rank keeps half of every block's codes and absmax codes (the nested
    scales and offsets whole beside them) and all-gathers each block's bytes before its
    forward and its backward: 2 x micro-batches x the padded packed bytes per step (tag
    "nf4"), 4.127/16 of what a bf16 base moves, less the replicated constants."""
    accum = 2
    out = world2.run(nf4_run, dp=2, zero=3, accum=accum)
    want = one_process(micro=2, accum=2 * accum)
    h, f, kv = 128, 512, 64
    weights = [h * h, h * kv, h * kv, h * h, h * f, h * f, h * f]  # one block's Linears
    packed = sum(n // 2 + n // 64 for n in weights)  # codes and absmax codes (even: no pad)
    for rank in out:
        assert_same_run(rank, want)
        assert rank["gathered"]["nf4"] == 2 * accum * 2 * packed  # 2 blocks
        bf16 = 2 * accum * 2 * 2 * sum(weights)  # the same gathers of a bf16 base
        constants = 4 * sum(-(-(n // 64) // 256) for n in weights)  # nested, not gathered
        assert rank["gathered"]["nf4"] + 2 * accum * 2 * constants == pytest.approx(
            bf16 * bits_per_weight() / 16, rel=1e-9, abs=2 * accum * 2 * 4 * 7
        )
    per_rank = out[0]["params"]
    assert per_rank == out[1]["params"] < 0.75 * want["params"]  # half the NF4 bytes each


@pytest.mark.parametrize("reshard", ["default", "always"])
def test_zero3_pipelined_nf4_equals_one_process(world2, reshard):
    out = world2.run(nf4_run, pp=2, zero=3, schedule="1f1b", accum=4,
                     reshard_after_forward=reshard)  # fmt: skip
    want = one_process(micro=2, accum=4)
    for rank in out:
        assert_same_run(rank, want)


@pytest.mark.parametrize(
    "case",
    [dict(recompute="full"), dict(recompute="full", offload_activations="cpu")],
    ids=_id,
)
def test_recompute_and_offload_nf4_equal_one_process(world2, case):
    out = world2.run(nf4_run, dp=2, accum=1, **case)
    want = one_process(micro=2, accum=2)
    for rank in out:
        assert_same_run(rank, want)


def test_nf4_bytes_are_the_format():
    """One process holds the quantized weights at 4.127 bits (+ 4 bytes of offset each) and
    the unquantized rest (embedding, head, norms) in fp32, the adapters in fp32."""
    run = one_process(micro=2, accum=2)
    h, f, layers, vocab, kv = 128, 512, 2, 256, 64
    quantized = layers * (2 * h * h + 2 * h * kv + 3 * h * f)
    codes = quantized // 2 + quantized // 64
    nested = layers * sum(-(-(n // 64) // 256) for n in (h * h, h * kv, h * kv, h * h,
                                                          h * f, h * f, h * f))  # fmt: skip
    rest = 4 * (2 * vocab * h + (2 * layers + 1) * h)
    adapters = 4 * sum(p.numel() for p in run["adapters"].values())
    assert run["params"] == codes + 4 * nested + 4 * 7 * layers + rest + adapters
    assert codes + 4 * nested == pytest.approx(quantized * bits_per_weight() / 8, rel=1e-3)
