"""LoRA's memory, estimated against measured: the frozen base at its dtype, the adapters'
states, and the activations autograd saves once the base is frozen (estimate/adapters.py).

Layouts run for real in one 2-rank world (the memory tracker's categories, its activation
meter, and the frozen parameters counted off the model), within the limits of
test_estimate_measured.py; the block-0 rules (nothing needs a gradient before the first
adapter) on bare single-process models for several target sets."""

from __future__ import annotations

import pytest
import torch

from memory_runs import Case, compare, error, measure
from memory_table import TABLE, is_lora
from plait.cli import main
from plait.estimate import estimate
from plait.estimate.core import chunk_activation_bytes
from plait.estimate.frozen_base import frozen_base
from plait.estimate.model_states import ElementBytes
from plait.estimate.rank_params import rank_params, tp_contract
from plait.memory_tracker import MemoryTracker
from plait.models.declare import is_adapter
from plait.models.transformer import Transformer, matmul_flops_per_token
from plait.parallel.activation_recompute import apply_recompute
from plait.plan.hardware import load_hardware
from plait.plan.step_time import Memo, step_time
from plait.plan.traffic import Links, base_elements, dp_traffic, tp_tables
from plait.schedule.stages import rank_plans
from sections import build_regrouped
from test_estimate_measured import LIMIT, STEP_TAGS, _planned, _small_collectives

ALL = {"lora_rank": 4, "lora_targets": "all"}
LAYOUTS = [
    Case("lora dp2 zero0", "small-llama", parallel={"dp": 2}, model=ALL),
    Case("lora dp2 zero1", "small-llama", parallel={"dp": 2, "zero": 1}, model=ALL),
    Case("lora dp2 zero2", "small-llama", parallel={"dp": 2, "zero": 2}, model=ALL),
    Case("lora dp2 zero1 gpt2 attn", parallel={"dp": 2, "zero": 1},
         model={"lora_rank": 8, "lora_targets": "attn"}),
    Case("lora tp2 sp", "small-llama", parallel={"tp": 2, "sequence_parallel": True}, model=ALL),
    Case("lora tp2 gpt2 dropout", parallel={"tp": 2},
         model={"lora_rank": 4, "lora_targets": "all", "lora_dropout": 0.1, "dropout": 0.1}),
    Case("lora pp2 1f1b", "small-llama", parallel={"pp": 2, "schedule": "1f1b"}, model=ALL,
         accum=4),
    Case("lora dp2 recompute full", "small-llama", parallel={"dp": 2, "recompute": "full"},
         model={"lora_rank": 4, "lora_targets": "mlp"}),
    # QLoRA: the blocks' Linear weights in NF4 (each rank its tp slice), the rest in fp32
    Case("qlora dp2 zero1", "small-llama", parallel={"dp": 2, "zero": 1, "base_dtype": "nf4"},
         model=ALL),
    Case("qlora tp2 sp", "small-llama", parallel={"tp": 2, "sequence_parallel": True,
                                                  "base_dtype": "nf4"}, model=ALL),
    Case("qlora pp2 1f1b", "small-llama", parallel={"pp": 2, "schedule": "1f1b",
                                                    "base_dtype": "nf4"}, model=ALL, accum=4),
    Case("qlora dp2 zero3", "small-llama", parallel={"dp": 2, "zero": 3, "base_dtype": "nf4"},
         model=ALL),
    Case("qlora pp2 zero3", "small-llama", parallel={"pp": 2, "zero": 3, "base_dtype": "nf4",
                                                     "schedule": "1f1b"}, model=ALL, accum=4),
    # the weight dequantized for a product at the peak: under full recomputation, and with
    # the down projection no target (its input not saved); bf16 products beside fp32 ones
    Case("qlora dp2 recompute full", "small-llama", parallel={"dp": 2, "base_dtype": "nf4",
                                                              "recompute": "full"}, model=ALL),
    Case("qlora dp2 zero3 attn", "small-llama", parallel={"dp": 2, "zero": 3,
         "base_dtype": "nf4"}, model={"lora_rank": 4, "lora_targets": "attn"}),
    Case("qlora dp2 bf16 upcast", "small-llama", parallel={"dp": 2, "zero": 1, "base_dtype": "nf4",
         "precision": "bf16", "base_upcast": True, "recompute": "full"}, model=ALL),
    # then docs/memory.md's LoRA rows (tests/memory_table.py): ZeRO-3 in fp32 and bf16, and
    # with full recomputation (its peak: a forward's block done)
] + [c for c in TABLE if is_lora(c)]  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS, ids=[x.name for x in LAYOUTS])
def test_lora_estimate_matches_measurement(world2, layout):
    est = estimate(layout.config())
    for measured in world2.run(measure, layout):
        pairs = compare(est, measured)
        assert pairs["frozen_base"][1] > 0
        for term, pair in pairs.items():
            assert abs(error(pair)) <= LIMIT, (layout.name, measured["pp_rank"], term, pair)
            if term not in ("activations", "total") and layout.parallel.get("zero") == 3:
                assert pair[0] == pair[1], (layout.name, term, pair)  # the base's shards too
        assert _small_collectives(measured) == _planned(layout, measured["pp_rank"])
        gathered, planned = _frozen_gathered(measured), _frozen_planned(layout, measured["pp_rank"])
        if layout.parallel.get("base_dtype") == "nf4":  # fp and packed units: in bytes
            gathered, planned = gathered[1:], planned[1:]
        assert gathered == planned, (layout.name, gathered, planned)
        if layout.parallel.get("tp", 1) > 1:
            assert _tp_rows(measured) == _tp_planned(layout), layout.name


def _frozen_gathered(measured: dict) -> tuple[int, int, int]:
    """(elements, bytes, calls) the step all-gathered of the frozen base (tags 'frozen'
    and, for an NF4 base's packed bytes, 'nf4')."""
    rows = [r for r in measured["comm"] if r["tag"] in ("frozen", "nf4")]
    assert all(r["op"] == "all_gather" and r["axis"] == "dp" for r in rows), rows
    return tuple(sum(r[key] for r in rows) for key in ("elements", "bytes", "calls"))


def _frozen_planned(layout: Case, pp_rank: int) -> tuple[int, int, int]:
    """What the estimate says of it (estimate/frozen_base.py): 2 x micro-batches x the
    padded base, at the base dtype; none below stage 3; and the calls `plait plan` prices
    (plan/traffic.py: an NF4 block's fp group and packed bytes, two gathers)."""
    cfg = layout.config()
    par = cfg.parallel
    plans = rank_plans(cfg.model.n_layers, par.pp, par.virtual_stages, pp_rank,
                       par.stage_layer_counts())  # fmt: skip
    prec = ElementBytes.of(cfg.train.precision, cfg.train.reduce_dtype)
    base = frozen_base(rank_params(tp_contract(cfg.model, par.tp), plans), cfg, prec)
    n = base.gathered_per_step(cfg.accumulation)
    calls = base_elements(cfg, plans)[1] if cfg.memory.zero == 3 and par.dp > 1 else 0
    return n, n * base.element, calls


def _tp_rows(measured: dict) -> dict:
    """{(op, tag): (calls, elements)} of the step's activation collectives over tp."""
    rows = [r for r in measured["comm"] if r["axis"] == "tp" and r["tag"] not in STEP_TAGS]
    return {(r["op"], r["tag"]): (r["calls"], r["elements"]) for r in rows}


def _tp_planned(layout: Case) -> dict:
    """What `plait plan` prices (plan/traffic.py `tp_tables`) over the step's micro-batches:
    r more features per row-parallel target, block 0's first column backward skipped."""
    cfg = layout.config()
    plan = rank_plans(cfg.model.n_layers, 1, 1, 0, cfg.parallel.stage_layer_counts())[0]
    out: dict = {}
    for table in tp_tables(cfg, plan, cfg.memory.recompute == "full"):
        for key, (calls, n) in table.items():
            was = out.get(key, (0, 0))
            out[key] = (was[0] + layout.accum * calls, was[1] + layout.accum * n)
    return out


def _saved_peak(cfg, mode: str) -> int:
    """The activation meter's peak over one forward and backward of a bare model whose
    base is frozen, as the contract declares it."""
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    apply_recompute(model, mode)
    model.train()
    t = cfg.train
    tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, t.seq_len))
    targets = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, t.seq_len))
    tracker = MemoryTracker()
    with tracker.activations():
        loss = model(tokens, targets)
        peak = tracker.peak("activations")
        loss.backward()
    return peak


BARE = [
    ("small-llama", {"lora_targets": "q,v"}, "none"),
    ("small-llama", {"lora_targets": "mlp"}, "none"),
    ("small-llama", {"lora_targets": "o,down"}, "none"),
    ("small-llama", {"lora_targets": "up", "lora_dropout": 0.2}, "none"),
    ("small-llama", {"lora_targets": "gate,down", "dropout": 0.1}, "selective"),
    ("small-gpt", {"lora_targets": "attn", "lora_dropout": 0.1}, "none"),
    ("small-gpt", {"lora_targets": "up", "lora_dropout": 0.1}, "none"),
    ("small-gpt", {"lora_targets": "down"}, "full"),
]


@pytest.mark.parametrize(("preset", "lora", "mode"), BARE)
def test_lora_activations_exact_per_target_set(preset, lora, mode):
    over = {
        "model": {"n_layers": 2, **lora},
        "lora": {"rank": 4},
        "memory": {"recompute": mode},
    }
    over["train"] = {"micro_batch": 2, "global_batch": 2, "seq_len": 32}
    cfg = build_regrouped(preset, over)
    plan = rank_plans(cfg.model.n_layers, 1, 1, 0, cfg.parallel.stage_layer_counts())[0]
    assert chunk_activation_bytes(cfg, plan) == pytest.approx(_saved_peak(cfg, mode), abs=64)


def test_frozen_base_at_base_dtype_and_adapter_states():
    """bf16: the base at 2 bytes (auto) or 4 (fp32), adapters 16 bytes each; ZeRO shards
    only the adapters' states, never the base."""
    cfgs = {}
    for name, par in {
        "auto": {"precision": "bf16"},
        "fp32 base": {"precision": "bf16", "base_dtype": "fp32"},
        "zero2": {"precision": "bf16", "dp": 4, "zero": 2},
    }.items():
        over = {
            "lora": {"rank": 8, "targets": "q,v"},
            "parallel": par,
        }
        over["train"] = {"micro_batch": 1, "global_batch": par.get("dp", 1), "seq_len": 64}
        cfgs[name] = estimate(build_regrouped("small-llama", over)).ranks[0]
    m = build_regrouped(
        "small-llama",
        {
            "lora": {"rank": 8, "targets": "q,v"},
        },
    ).model
    adapters = m.n_layers * 2 * 8 * (m.d_model + m.d_model)  # q: (8,128)+(128,8); v: kv 64
    adapters -= m.n_layers * 8 * (m.d_model - m.kv_heads * m.head_dim)
    auto = cfgs["auto"]
    assert auto.model_states() - auto.frozen() == 16 * adapters
    assert cfgs["fp32 base"].frozen() == 2 * auto.frozen() == 4 * (auto.frozen() // 2)
    zero2 = cfgs["zero2"]
    assert zero2.frozen() == auto.frozen()  # replicated
    assert zero2.line("optimizer_states").device == auto.line("optimizer_states").device // 4


def test_plan_prices_no_weight_gradients_for_a_frozen_base():
    """Under LoRA the backward computes input gradients and the adapters' weight gradients
    only: compute = (2 + adapter share) forwards, not 3; the dp traffic is the adapters'."""

    over = {"parallel": {"dp": 2}, "train": {"global_batch": 4, "micro_batch": 2, "seq_len": 64}}
    full = build_regrouped("small-llama", over)
    lora = build_regrouped(
        "small-llama",
        over
        | {
            "lora": {"rank": 4, "targets": "q,v"},
        },
    )
    hw = load_hardware("h100")
    times = {n: step_time(c, hw, 8, Memo()) for n, c in (("full", full), ("lora", lora))}
    forward = matmul_flops_per_token(full.model, 64) / 3 * 2 * 64 / hw.flop_rate
    phi = lora.model.n_layers * 4 * (128 + 128 + 128 + 64)  # q: A + B; v: A + B (kv 64)
    share = 2 * phi / (matmul_flops_per_token(full.model, 64) / 3)
    overhead = times["full"].compute - 3 * forward
    assert times["lora"].compute == pytest.approx((2 + share) * (forward + overhead / 3))
    plans = rank_plans(4, 1, 1, 0, [4])
    links = Links.of(full, hw, 8)
    assert dp_traffic(lora, links.dp, plans, {}).shard == phi  # ZeRO-0: all of it
    assert dp_traffic(full, links.dp, plans, {}).shard > 100 * phi


def test_plan_lora_flags(tmp_path, capsys):
    argv = ["plan", "--model", "small-llama", "--gpus", "2", "--global-batch", "4"]
    argv += ["--seq-len", "64", "--hardware", "cpu", "--top", "2"]
    out = tmp_path / "plan.toml"
    assert main([*argv, "--lora-rank", "4", "--lora-targets", "all", "--out", str(out)]) == 0
    text = out.read_text()
    assert "[lora]\nrank = 4" in text and 'targets = "all"' in text
    assert main(["estimate", "--config", str(out), "--json"]) == 0
    assert '"frozen_base"' in capsys.readouterr().out
    assert main([*argv, "--lora-targets", "q"]) == 2
    assert "--lora-targets given without --lora-rank" in capsys.readouterr().err
    assert main([*argv, "--lora-rank", "200"]) == 2
    assert "--lora-rank 200 exceeds the width of attn.wq" in capsys.readouterr().err
