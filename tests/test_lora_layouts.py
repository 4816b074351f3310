"""LoRA (base frozen, adapters trained) under tensor, sequence and data parallelism equals one
process exactly (fp32): losses and gradient norms every step (rtol 1e-5), adapters and base
after the run, validation loss (tests/lora_parity.py). Each rank also shows the base frozen:
no `.grad`, unchanged bits, and optimizer states and gradient buckets of the adapters' bytes
only. Pipelines and 2BW: tests/test_lora_pipelines.py."""

from __future__ import annotations

import pytest

from lora_parity import lora_parity


def _id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


def _holds_adapters_only(rank: dict) -> None:
    """Adam's two fp32 moments, one fp32 gradient and no master copy (fp32: the parameter is
    its own master), each of the adapters alone."""
    assert rank["states"] == 2 * rank["adapter_bytes"], rank
    assert rank["grads"] == rank["adapter_bytes"], rank
    assert rank["masters"] == 0, rank


TP2 = [
    dict(preset="tiny-llama", tp=2, accum=2),  # grouped-query attention: wk, wv narrower
    dict(preset="tiny-gpt", tp=2),  # q, k, v share one A (c_attn)
    dict(preset="tiny-llama", tp=2, sequence_parallel=True),
    dict(preset="tiny-gpt", tp=2, sequence_parallel=True, accum=2),
]
DROPOUT = dict(lora_dropout=0.1)


@pytest.mark.parametrize("case", TP2, ids=_id)
def test_tensor_parallel_lora_equals_one_process(world2, case):
    plain = world2.run(lora_parity, **case)
    assert plain[0]["losses"] == plain[1]["losses"]
    for rank in plain:
        _holds_adapters_only(rank)
    names = plain[0]["adapters"]
    assert len(names) == (28 if case["preset"] == "tiny-llama" else 20), names  # 2 layers
    if case["preset"] == "tiny-gpt":  # wk, wv hold only their rows of B
        assert "blocks.0.attn.wk.lora_a" not in names and "blocks.0.attn.wk.lora_b" in names
    # Adapter dropout: the row-parallel adapter's input is split by features and its mask is
    # this rank's slice of the whole one, so the keyed masks do not depend on the layout.
    dropped = world2.run(lora_parity, **case, **DROPOUT)
    assert dropped[0]["losses"][1:] != plain[0]["losses"][1:]  # the masks are live


DP2 = [
    dict(preset="tiny-llama", dp=2, accum=2),
    dict(preset="tiny-gpt", dp=2, lora_dropout=0.1),
]


@pytest.mark.parametrize("case", DP2, ids=_id)
def test_data_parallel_lora_equals_one_process(world2, case):
    for rank in world2.run(lora_parity, **case):
        _holds_adapters_only(rank)
        # One default-sized bucket of adapter gradients per step; the base is never reduced.
        assert (rank["dp_grad_bytes"], rank["dp_grad_calls"]) == (rank["adapter_bytes"], 1)


def test_naive_data_parallel_lora_equals_one_process(world2):
    out = world2.run(lora_parity, preset="tiny-llama", dp=2, accum=2, dp_mode="naive")
    coordinator, worker = out
    assert coordinator["states"] == 2 * coordinator["adapter_bytes"]  # rank 0 steps alone
    assert worker["states"] == 0
    for rank in out:
        assert rank["grads"] == rank["adapter_bytes"] and rank["masters"] == 0, rank
        assert rank["params"] == rank["adapter_bytes"] + rank["base_bytes"], rank  # base tracked
        # The frozen base never crosses the wire: the adapters' gradients go to rank 0 and
        # their new values come back (plus the grad norm, fp64, and the loss).
        assert rank["bytes"]["reduce"] == rank["adapter_bytes"], rank["bytes"]
        assert rank["bytes"]["broadcast"] == rank["adapter_bytes"] + 8 + 4, rank["bytes"]
