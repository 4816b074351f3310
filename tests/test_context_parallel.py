"""Context parallelism (--cp) is exact: cp2 equals one process (loss and gradient norm every
step, parameters after the run, validation loss; fp32, rtol 1e-5) on packed rows whose
documents straddle the cut (tests/packed_rows.py: documents of 2..16 tokens in rows of 32,
each rank holding 16), with either exchange, with LoRA and with ZeRO-3; and the comm layer
counts the exchange's elements of the formula."""

from __future__ import annotations

from dataclasses import replace

import pytest

from context_parallel import cp_parity, moved_places
from plait.composition import check_context_parallel
from plait.errors import ConfigError
from plait.models.architecture import ModelConfig


def _kv_elements(preset: str) -> int:
    """b·s·kv·hd of one layer's keys at small_config's micro-batch 2 and rows of 32."""
    kv, hd = {"tiny-gpt": (4, 16), "tiny-llama": (2, 16)}[preset]
    return 2 * 32 * kv * hd


def test_cp2_allgather_equals_one_process_and_moves_the_formulas_bytes(world2):
    """allgather: per layer 2·b·s·kv·hd elements gathered forward (of which (cp−1)/cp from
    the other rank) and as many reduce-scattered backward, two layers, one micro-batch."""
    out = world2.run(cp_parity)
    assert out[0]["losses"] == out[1]["losses"]
    layers, kv = 2, _kv_elements("tiny-gpt")
    for rank in out:
        traffic = rank["traffic"]
        assert traffic["cp_kv"] == layers * 2 * kv
        assert traffic["cp_kv_grad"] == layers * 2 * kv
        assert traffic["cp_ring_kv"] == 0


def test_cp2_ring_equals_one_process_with_gqa(world2):
    """The ring (log-sum-exp merge, dK and dV passed back) on LLaMA with grouped-query
    attention, K and V passed with their 2 kv heads (not the 4 query heads): forward
    (cp−1) blocks of 2·b·(s/cp)·kv·hd a layer, backward the blocks with their dK and dV,
    then the dK and dV home."""
    out = world2.run(cp_parity, exchange="ring", preset="tiny-llama", steps=4)
    assert out[0]["losses"] == out[1]["losses"]
    layers, block = 2, _kv_elements("tiny-llama") // 2  # this rank's s/cp tokens
    for rank in out:
        traffic = rank["traffic"]
        assert traffic["cp_ring_kv"] == layers * 2 * block  # sends: cp - 1 = 1 block of K, V
        assert traffic["cp_ring_back"] == layers * 4 * block
        assert traffic["cp_ring_home"] == layers * 2 * block
        assert traffic["cp_kv"] == 0


def test_cp2_with_lora(world2):
    out = world2.run(cp_parity, lora=4, steps=4)
    assert out[0]["losses"] == out[1]["losses"]


def test_cp2_with_zero3_accumulation_and_recompute(world2):
    """ZeRO-3 shards over dp x cp (here the two cp ranks), two micro-batches a step, each
    block recomputed in backward (its exchange with it)."""
    out = world2.run(cp_parity, zero=3, accum=2, micro=1, steps=4, preset="tiny-llama",
                     recompute="full")  # fmt: skip
    assert out[0]["losses"] == out[1]["losses"]


DOCUMENT_1 = list(range(10, 22))


def test_probe_without_cp():
    """TRL's probe on one process: one changed token of document 1 moves exactly document
    1's places (it is the document's first token, so every one of them)."""
    assert moved_places()["moved"] == DOCUMENT_1


@pytest.mark.parametrize("exchange", ["allgather", "ring"])
def test_probe_with_cp2(world2, exchange):
    """With cp2, each rank holding pieces of all three documents: the places that move,
    over both ranks, are exactly document 1's (TRL measured every place moving when context
    parallelism dropped the mask), and every logit equals one process's."""
    out = world2.run(moved_places, exchange)
    assert sorted(out[0]["moved"] + out[1]["moved"]) == DOCUMENT_1
    assert out[0]["moved"] and out[1]["moved"]  # document 1 straddles the cut
    assert out[0]["equal"] and out[1]["equal"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(cp=3), r"--cp 3 does not divide the row length --seq-len 32"),
        (dict(cp=2, tp=4, sequence_parallel=True, seq_len=36),
         r"--cp 2 leaves 18 tokens of each row per rank \(--seq-len 36\), which sequence "
         r"parallelism cannot split over tp=4"),
        (dict(cp=2, pp=2, schedule="2bw"), r"--cp 2 does not combine with --schedule 2bw"),
        (dict(cp=2, dp_mode="naive"), r"--cp 2 does not combine with --dp-mode naive yet"),
        (dict(cp=2, model=replace(ModelConfig(), dropout=0.1)),
         r"--cp 2 does not combine with --dropout 0.1 yet"),
        (dict(cp=2, model=replace(ModelConfig(), sliding_window=8)),
         r"--cp 2 does not combine with --sliding-window 8 yet"),
        (dict(cp=2, model=replace(ModelConfig(), attn_softcap=50.0)),
         r"--cp 2 does not combine with --attn-softcap 50.0 yet"),
        (dict(exchange="zigzag"), r"cp_exchange must be one of allgather, ring; got 'zigzag'"),
    ],
)  # fmt: skip
def test_layouts_cp_cannot_run_are_refused_by_name(args, message):
    full = dict(cp=1, exchange="allgather", seq_len=32, tp=1, sequence_parallel=False, pp=1,
                schedule="1f1b", dp_mode="ddp", model=ModelConfig()) | args  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        check_context_parallel(**full)
