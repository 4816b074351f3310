"""ZeRO stages 1-3 train exactly like stage 0 (DataParallel + torch AdamW), in fp32.

The reference (zero_helpers.reference: the plain loop, per-parameter all-reduce, torch
AdamW) and the engine, trained by the production step (`Trainer.train_step`), run in the
same worker, one after the other, on the same data.

Bitwise: without gradient clipping, every stage computes each element by the same sum and
the same AdamW arithmetic as stage 0, so loss, gradients and parameters are *equal*,
uneven partitions included; stage 1 also with accumulation (it accumulates locally, as
stage 0 does).

Rounding-level: with clipping, the global norm is summed in another order (per shard, then
over ranks: a few ulps); stages 2-3 with accumulation reduce every micro-batch (Σ_micro
Σ_rank instead of Σ_rank Σ_micro). Asserted: loss and gradient norm at rtol 1e-6 every
step; the first step's gradients at rtol 1e-6 of each tensor's scale (rounding in a sum
scales with the summands, not with the result); the parameters after 10 steps within
1e-5 (the data-parallel parity bound) and at relative L2 error 1e-5 per tensor. Later
gradients are not compared element-wise: from step 2 on they are taken at parameters that
already differ, and Adam moves an element whose gradient is at rounding-noise level by
that noise (the key bias's true gradient is zero: softmax ignores a constant added to
every score), so such elements differ at 1e-6 after 10 steps whatever the implementation.
"""

from __future__ import annotations

import pytest
import torch

from plait.parallel.zero.layout import FlatGroup, padded_size
from plait.parallel.zero.state_dict import assemble
from reference import corpus_for
from zero_helpers import (
    EngineStep,
    parity,
    record,
    reference,
    train,
    with_zero,
    zero_config,
    zero_trainer,
)

# -------------------------------------------------------- pure: layout (AdamW: test_adamw.py)


def _group(sizes: list[int], world: int, rank: int) -> FlatGroup:
    params = [
        torch.nn.Parameter(torch.zeros(s) if s < 10 else torch.zeros(2, s // 2)) for s in sizes
    ]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    numel = sum(sizes)
    names = [f"p{i}" for i in range(len(sizes))]
    return FlatGroup(0, params, names, offsets, numel, padded_size(numel, world), rank, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_cover_every_element_once(world):
    sizes = [7, 20, 3, 30, 5]  # 65 elements: uneven for 2, 3 and 4
    seen = []
    for rank in range(world):
        g = _group(sizes, world, rank)
        assert g.padded % world == 0 and 0 <= g.padding < world
        for piece in g.pieces():
            assert piece.shard_offset >= 0 and piece.shard_offset + piece.length <= g.shard_numel
            seen += [(piece.param, piece.start + i) for i in range(piece.length)]
    assert sorted(seen) == [(i, j) for i, s in enumerate(sizes) for j in range(s)]


def test_decay_segments_are_the_matrices_of_the_shard():
    g = _group([7, 20, 3, 30, 5], world=2, rank=0)  # shard 0: elements 0..32
    assert g.decay_segments() == [(7, 27), (30, 33)]  # the 20 and the start of the 30 (2-D)
    g = _group([7, 20, 3, 30, 5], world=2, rank=1)  # shard 1: 33..65, padding 1
    assert g.decay_segments() == [(0, 27)]


# ---------------------------------------------------------------- multi-rank parity
# Every engine run below goes through the production step (`Trainer.train_step`, or
# `plait.step.Step` over a test-built engine where no config field carries the option);
# the reference is the plain data-parallel loop (zero_helpers.reference).


BITWISE = [
    dict(preset="tiny-gpt"),
    dict(preset="tiny-llama"),
    dict(preset="tiny-gpt", d_model=45, n_heads=3),  # odd sizes: uneven shards
    dict(preset="tiny-gpt", recompute="full", dropout=0.1),  # stage 3 gathers in recompute
]


@pytest.mark.parametrize("case", BITWISE, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_bitwise_equal_without_clipping(world2, case):
    results = world2.run(parity, [1, 2, 3], exact=True, clip=0.0, **case)
    for stage in (1, 2, 3):  # the two ranks' shards partition the parameters exactly
        assert sum(r[stage]["elements"] for r in results) == results[0]["numel"]
    assert results[0][3]["groups"] == 3  # stage 3: two blocks and the root
    if "d_model" in case:
        assert all(results[0][s]["padding"] > 0 for s in (1, 2, 3))


def test_stage1_bitwise_with_accumulation(world2):
    world2.run(parity, [1], exact=True, clip=0.0, accum=3)


CASES_2 = [
    dict(preset="tiny-gpt", accum=3),
    dict(preset="tiny-llama", accum=2),
    dict(preset="tiny-gpt", accum=2, d_model=45, n_heads=3),
]


@pytest.mark.parametrize("case", CASES_2, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_stages_match_stage0_with_clipping_and_accumulation(world2, case):
    world2.run(parity, [1, 2, 3], exact=False, clip=1.0, **case)


# ---------------------------------------------------------------- state per parameter


def _states(stage: int, bucket_mb: float, load: dict | None = None) -> dict:
    cfg = zero_config(steps=4)
    cfg.optim.grad_clip = 0.0
    corpus = corpus_for(cfg)
    out = {}
    if load is None:
        out["torch"] = reference(cfg, corpus).optimizer
        trainer = train(cfg, corpus, stage, bucket_mb=bucket_mb)[1]
    else:
        trainer = zero_trainer(cfg, corpus, stage, bucket_mb=bucket_mb)
        trainer.engine.load_state_dict({"params": load, "step": 4})
        out["params"] = record(trainer, steps=0).params
    out["pieces"] = trainer.engine.state_dict()["pieces"]
    trainer.close()
    return out


def test_state_per_parameter_reassembles_and_reloads_under_another_layout(world2):
    """Stage 2's pieces from both ranks = torch AdamW's state; loaded into stage 3 (other
    groups, other shard boundaries), they come back out identical."""
    results = world2.run(_states, 2, 0.01)
    full = assemble(results[0]["pieces"] + results[1]["pieces"])
    expected = results[0]["torch"]
    assert full.keys() == expected.keys()
    for name, state in expected.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(full[name][key], state[key]), (name, key)
    reloaded = world2.run(_states, 3, 0.01, load=full)
    again = assemble(reloaded[0]["pieces"] + reloaded[1]["pieces"])
    for name, state in full.items():
        assert torch.equal(reloaded[0]["params"][name], state["master"])
        for key in state:
            assert torch.equal(again[name][key], state[key]), (name, key)
    with pytest.raises(ValueError, match=r"covers \d+ of \d+"):
        assemble(results[0]["pieces"])  # one rank's pieces alone are not the whole


# ---------------------------------------------------------------- offload


def _offload(stage: int, precision: str, directory: str) -> dict:
    """CPU and NVMe offload against no offload: the same numbers, bit for bit. NVMe with a
    sub-group of 0.01 MiB (many of them), which no config field sets: its engine is built
    here and run by the production step (zero_helpers.EngineStep)."""
    cfg = zero_config(accum=2, steps=6)
    corpus = corpus_for(cfg)
    runs = {
        "none": train(cfg, corpus, stage, precision=precision),
        "cpu": train(cfg, corpus, stage, precision=precision, offload="cpu"),
    }
    nvme = with_zero(cfg, stage, precision, offload="nvme", offload_dir=directory)
    nvme_step = EngineStep(nvme, corpus, sub_group_mb=0.01)
    runs["nvme"] = record(nvme_step), nvme_step
    base, base_trainer = runs["none"]
    base_states = base_trainer.engine.state_dict()["pieces"]
    for kind in ("cpu", "nvme"):
        got, trainer = runs[kind]
        assert got.losses == base.losses and got.norms == base.norms, kind
        for name, value in base.params.items():
            assert torch.equal(got.params[name], value), (kind, name)
        for mine, theirs in zip(trainer.engine.state_dict()["pieces"], base_states, strict=True):
            for key, value in theirs.tensors.items():
                assert torch.equal(mine.tensors[key], value), (kind, mine.name, key)
    engine = nvme_step.engine
    memory, states = engine.memory, engine.states
    out = {
        "sub_group": states.staging["master"].numel(),
        "shard_elements": sum(g.shard_numel for g in engine.groups),
        "resident": {
            c: memory.persistent(c, "host") for c in ("master_weights", "optimizer_states")
        },
        "device": {
            c: memory.persistent(c, "device") for c in ("master_weights", "optimizer_states")
        },
        "disk": memory.current(place="disk"),
        "file_bytes": states.path.stat().st_size,
        "chunks": len(states.layout),
    }
    path = states.path
    for _, trainer in runs.values():
        trainer.close()
    out["file_removed"] = not path.exists()
    return out


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "bf16"), (3, "bf16")])
def test_cpu_and_nvme_offload_equal_no_offload(world2, tmp_path, stage, precision):
    r = world2.run(_offload, stage, precision, str(tmp_path))[0]
    # NVMe: what stays in memory is one sub-group of master + two moments (12 B/element);
    # the files hold all of this rank's shard; nothing of it on the device.
    assert r["chunks"] > 10  # streamed through many sub-groups
    assert r["resident"] == {
        "master_weights": 4 * r["sub_group"],
        "optimizer_states": 8 * r["sub_group"],
    }
    assert r["sub_group"] == int(0.01 * 2**20) // 12
    assert r["device"] == {"master_weights": 0, "optimizer_states": 0}
    assert r["disk"] == r["file_bytes"] == 12 * r["shard_elements"]
    assert r["file_removed"]
