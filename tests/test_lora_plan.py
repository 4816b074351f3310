"""`plait plan` under LoRA weighs the frozen base whole (ZeRO 0-2: no base traffic) against
sharded (ZeRO-3: 2 x micro-batches x the base all-gathered per step) by memory and predicted
time, and says which it picked and why (plan/lora_base.py). No process starts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plait.cli import main
from plait.estimate.frozen_base import frozen_base
from plait.estimate.model_states import ElementBytes, flat_groups
from plait.estimate.rank_params import rank_params, total_parameters, tp_contract
from plait.models.presets import get_preset
from plait.plan.enumerate import Request
from plait.plan.hardware import load_hardware
from plait.plan.headroom import DEFAULT, HEADROOM, headroom_bytes
from plait.plan.lora_base import base_line, base_sides
from plait.plan.search import config_of, plan
from plait.plan.step_time import Memo, step_time
from plait.plan.traffic import Links, dp_traffic
from plait.schedule.stages import rank_plans
from sections import build_regrouped

GIB = 2**30


def _request() -> Request:
    model = get_preset("llama-7b")
    model.lora_rank, model.lora_targets = 8, "q,v"
    return Request(model, "llama-7b", 8, 8, 64, 512, "bf16", 8, None, ())


@pytest.fixture(scope="module")
def roomy():
    return plan(_request(), load_hardware("h100"), 80 * GIB, top=8)


@pytest.fixture(scope="module")
def small():
    """12 GB cards with `plait plan`'s default headroom (10%: 10.8 GiB usable)."""
    kept = headroom_bytes(HEADROOM(DEFAULT), 12 * GIB)
    return plan(_request(), load_hardware("h100"), 12 * GIB, top=3, headroom=kept)


def test_80gb_keeps_the_base_whole(roomy):
    """On 8 x 80 GB the base fits whole: ZeRO-3 would all-gather 2 x 8 micro-batches x
    6.7 G elements x 2 B per step (the all-gathers at the base's dtype) for nothing."""
    pick = roomy.ranked[0]
    assert pick.candidate.zero < 3
    whole, shard = base_sides(roomy)
    assert whole.zero == pick.candidate.zero and shard.zero == 3
    psi = total_parameters(_request().model, trainable=False)
    m = 64 // 8 // pick.candidate.micro_batch
    assert shard.gathered == 2 * m * psi * 2 and whole.gathered == 0
    assert shard.memory < whole.memory and shard.base == psi * 2 // 8
    assert shard.seconds > whole.seconds  # the gathers are priced, not all hidden
    line = base_line(roomy)
    assert line.startswith(f"LoRA base: ZeRO-{whole.zero} holds it whole, 12.551 GiB")
    assert f"all-gathers {shard.gathered / 1e9:,.1f} GB of it per step" in line
    assert f"picked ZeRO-{whole.zero}: it fits and is " in line and "moving no base" in line


def test_a_tie_goes_to_the_base_kept_whole(roomy):
    """Where ZeRO-3's gathers hide behind compute (one micro-batch of 8 x 512 tokens), its
    predicted time ties with the replicated base: the cut keeps the base whole."""
    ranked = [r for r in roomy.ranked if r.candidate.micro_batch == 8]
    assert ranked and ranked[0].candidate.zero < 3
    r = ranked[0]
    t3 = step_time(config_of(_request(), replace(r.candidate, zero=3)),
                   roomy.hardware, 8, Memo()).total  # fmt: skip
    assert abs(t3 - r.time.total) <= 0.01 * r.time.total


def test_12gb_shards_the_base(small, capsys):
    """A bf16 LLaMA-7B base (12.55 GiB) does not fit 12 GB whole at dp 8: ZeRO-3, said so,
    naming the headroom that the usable bytes leave out."""
    pick = small.ranked[0]
    assert pick.candidate.zero == 3 and pick.candidate.dp == 8
    whole, shard = base_sides(small)
    assert not whole.fits and whole.seconds is None and shard.fits
    line = base_line(small)
    assert f"ZeRO-2 holds it whole, 12.551 GiB of {whole.memory / GIB:,.3f} GiB" in line
    assert ", does not fit; ZeRO-3 shards it, 1.569 GiB of " in line
    assert line.endswith(
        f"picked ZeRO-3: ZeRO-2 needs {whole.memory / GIB:,.3f} GiB, more than the "
        "10.800 GiB usable (12.000 GiB less 1.200 GiB of headroom) per GPU."
    )


def test_plan_prints_the_line(capsys):
    argv = ["plan", "--model", "llama-7b", "--gpus", "8", "--global-batch", "64"]
    argv += ["--seq-len", "512", "--gpu-memory", "12GiB", "--top", "1"]
    assert main([*argv, "--lora-rank", "8"]) == 0
    out = capsys.readouterr().out
    assert "LoRA base: ZeRO-2 holds it whole" in out and "picked ZeRO-3: ZeRO-2 needs" in out
    assert main([*argv[:-2], "--gpu-memory", "80GiB"]) == 0  # no LoRA: no such line
    assert "LoRA base" not in capsys.readouterr().out


def test_stage_3_prices_the_base_gathers():
    """dp_traffic under ZeRO-3 adds the base's all-gathers to the adapters': every unit
    twice per micro-batch, padded to dp, at --base-dtype, one call each, on the dp link;
    ZeRO-2 moves no base."""
    over = {
        "parallel": {"dp": 4},
        "memory": {"zero": 3},
        "lora": {"base_dtype": "bf16"},
        "train": {"precision": "fp32"},
    }
    over |= {"train": {"global_batch": 8, "micro_batch": 1, "seq_len": 64}}
    over["model"] = {"lora_rank": 4, "lora_targets": "all"}
    cfg = build_regrouped("small-llama", over)
    plans = rank_plans(cfg.model.n_layers, 1, 1, 0, [cfg.model.n_layers])
    link = Links.of(cfg, load_hardware("h100"), 8).dp
    k = cfg.accumulation
    params = rank_params(tp_contract(cfg.model, 1), plans)
    base = frozen_base(params, cfg, ElementBytes.of("fp32", None))
    assert len(base.units) == cfg.model.n_layers + 1 and base.element == 2
    assert base.padded >= total_parameters(cfg.model, trainable=False) > base.padded - 4 * 5
    traffic = dp_traffic(cfg, link, plans)
    assert traffic.base_bytes == 2 * k * base.padded * 2
    groups = flat_groups(params, 3, cfg.parallel.bucket_mb, 4)
    adapters = sum(p for _, p in groups)
    expected = link.time("all_gather", 4, 2 * k * adapters * 4, 2 * k * len(groups))
    expected += link.time("all_gather", 4, traffic.base_bytes, 2 * k * len(base.units))
    assert traffic.gather_s == pytest.approx(expected)
    zero2 = build_regrouped(
        "small-llama",
        over
        | {
            "parallel": {**over["parallel"]},
            "memory": {"zero": 2},
        },
    )
    assert dp_traffic(zero2, link, plans).base_bytes == 0
