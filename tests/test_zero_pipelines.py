"""ZeRO-2 and ZeRO-3 through every synchronous pipeline schedule equal one process (fp32).

One world of 4 (dp2 x pp2) runs every case: stage 2, stage 3 keeping the stage gathered
through the step (--reshard-after-forward default) and regathering per micro-batch
(always), each in naive, GPipe, 1F1B, interleaved and ZB-H1. Loss and gradient norm every
step (rtol 1e-5), the validation loss and every parameter after the run equal the plain
loop's (tests/reference.py), and the step's counted bytes equal the formula: the stage's
flat groups reduce-scattered once per step, and all-gathered once per step (stage 2 after
the update; stage 3 keep) or, regathering, each block once per forward and once per
gradient pass of each micro-batch (the ends kept through the step), and what `plait plan`
prices. In the same world: a LoRA run under ZeRO-2/3 (its base's gathers counted too),
bf16/fp16 against the fp32 run, the estimator against the memory tracker (also on
docs/memory.md's 4-rank rows), and a ZeRO-3 checkpoint resumed in its own layout and under
ZeRO-2; without a world: the planner's offer of both ZeRO-3 policies, and bad
`--reshard-after-forward` values (one line, exit 2).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lora_parity import lora_config
from memory_runs import Case, compare, error, measure
from memory_table import TABLE
from plait.cli import main
from plait.errors import ConfigError
from plait.estimate import estimate
from plait.mesh import build_mesh
from plait.models.declare import is_adapter
from plait.models.presets import get_preset
from plait.plan.enumerate import Request, knobs, shapes
from plait.plan.hardware import load_hardware
from plait.plan.search import config_of
from plait.plan.step_time import Memo, step_time
from plait.plan.traffic import base_elements, dp_elements
from plait.train import Trainer
from reference import assert_matches_reference, corpus_for, reference_run, small_config
from sections import build_regrouped
from test_checkpoint import AT, STEPS, _params_by_name, _phase, _reference
from test_estimate_measured import check_layout
from whole_params import whole_params

PARAM_ATOL = 5e-5  # see test_pp_parity.py


def _expected_gathers(trainer: Trainer, reshard: str, gatherer=None) -> int:
    """All-gathered bytes of one step by the formula in the module docstring: of the
    trainable parameters, or of `gatherer`'s groups (a LoRA run's frozen base)."""
    engine, cfg = trainer.engine, trainer.cfg
    groups = gatherer.store.groups if gatherer else engine.groups
    sizes = [g.padded * 4 for g in groups]
    if engine.stage == 2 or reshard != "always":
        return sum(sizes)
    gatherer = gatherer or engine.gatherer
    ends = sum(sizes[gi] for gi in gatherer.ends)
    plans, m = trainer.pipeline.plans, cfg.accumulation
    split = trainer.pipeline.schedule.split_backward
    blocks = 0
    for i, chunk in enumerate(gatherer.chunk):
        passes = 2 + (split and not plans[chunk].first)  # F, B, W (the first stage: B empty)
        blocks += sizes[gatherer.group_of(i)] * passes * m
    return ends + blocks


def _parity(zero: int, reshard: str = "default", sequence_parallel: bool = False, **kw) -> dict:
    """Train, count the last step's dp bytes, compare with one process (on every rank)."""
    cfg = small_config(**kw)
    cfg.memory.zero, cfg.memory.reshard_after_forward = zero, reshard
    cfg.parallel.sequence_parallel = sequence_parallel
    cfg.validate()
    corpus = corpus_for(cfg)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus)
    results = [trainer.train_step() for _ in range(cfg.train.steps)]
    stats = trainer.comm.stats
    counted = {
        "reduce_scatter": stats.total("reduce_scatter", "grad", "dp")[2],
        "all_gather": stats.total("all_gather", "params", "dp")[2],
    }
    expected = {
        "reduce_scatter": sum(g.padded * 4 for g in trainer.engine.groups),
        "all_gather": _expected_gathers(trainer, reshard),
    }
    planned = dp_elements(cfg, trainer.pipeline.plans)  # what plait plan prices
    assert {op: n * 4 for op, (n, _) in planned.items()} == expected, (planned, expected)
    val = trainer.evaluate()
    params = whole_params(trainer)
    trainer.close()
    assert_matches_reference(cfg, corpus, results, params, val, PARAM_ATOL)
    return {"counted": counted, "expected": expected, "loss": results[-1].loss}


SCHEDULES = [
    dict(preset="tiny-llama", schedule="naive", accum=2),
    dict(preset="tiny-gpt", schedule="gpipe", accum=3),
    dict(preset="tiny-gpt", schedule="1f1b", accum=4, dropout=0.1),
    dict(preset="tiny-gpt", schedule="interleaved", virtual_stages=2, n_layers=4, accum=4),
    dict(preset="tiny-llama", schedule="zb-h1", accum=4),
]
CASES = [
    dict(zero=zero, reshard=reshard, **case)
    for zero, reshard in ((2, "default"), (3, "default"), (3, "always"))
    for case in SCHEDULES
]


def _id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_zero_2_3_through_a_pipeline_equal_one_process(world4, case):
    out = world4.run(_parity, dp=2, pp=2, steps=4, **case)
    assert len({o["loss"] for o in out}) == 1
    for rank in out:
        assert rank["counted"] == rank["expected"], rank


def _lora_parity(zero: int, reshard: str, **kw) -> dict:
    """A LoRA run (frozen base) under ZeRO-2/3 through the pipeline against one process: the
    base never moves, the adapters train, the base's all-gathers (stage 3) counted."""
    cfg = lora_config(**kw)
    cfg.memory.zero, cfg.memory.reshard_after_forward = zero, reshard
    cfg.validate()
    corpus = corpus_for(cfg)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus)
    start = whole_params(trainer)
    results = [trainer.train_step() for _ in range(cfg.train.steps)]
    frozen = trainer.comm.stats.total("all_gather", "frozen", "dp")[2]
    expected = 0
    if zero == 3:
        expected = _expected_gathers(trainer, reshard, trainer.engine.pipeline_actions.gatherers[1])
        planned = base_elements(cfg, trainer.pipeline.plans)[0] * 4  # what plait plan prices
        assert planned == expected, (planned, expected)
    val = trainer.evaluate()
    params = whole_params(trainer)
    trainer.close()
    for name, p in params.items():
        assert torch.equal(p, start[name]) != is_adapter(name), name
    assert_matches_reference(cfg, corpus, results, params, val, PARAM_ATOL)
    return {"frozen": frozen, "expected": expected}


LORA = [
    dict(zero=3, reshard="default", schedule="1f1b", preset="tiny-llama", accum=3),
    dict(zero=3, reshard="always", schedule="zb-h1", preset="tiny-gpt", accum=2),
    dict(zero=2, reshard="default", schedule="interleaved", preset="tiny-gpt", accum=2,
         virtual_stages=2, n_layers=4),
]  # fmt: skip


@pytest.mark.parametrize("case", LORA, ids=_id)
def test_lora_through_a_pipeline_equals_one_process(world4, case):
    out = world4.run(_lora_parity, dp=2, pp=2, **case)
    for rank in out:  # the base gathered as the adapters are (never under zero 2)
        assert rank["frozen"] == rank["expected"], rank


def _mixed(zero: int, precision: str, **kw) -> dict:
    """A few 16-bit steps against the fp32 single process: a missing loss scale, unscale or
    cast of the gathered parameters would be far off."""
    cfg = small_config(steps=3, **kw)
    cfg.memory.zero, cfg.train.precision = zero, precision
    cfg.validate()
    corpus = corpus_for(cfg)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus)
    losses = [trainer.train_step().loss for _ in range(cfg.train.steps)]
    trainer.close()
    return {"losses": losses, "ref": reference_run(cfg, corpus)[0]}


@pytest.mark.parametrize(("zero", "precision"), [(3, "bf16"), (2, "fp16")])
def test_mixed_precision_through_the_pipeline(world4, zero, precision):
    out = world4.run(_mixed, zero, precision, preset="tiny-gpt", dp=2, pp=2, accum=4)[0]
    torch.testing.assert_close(
        torch.tensor(out["losses"]), torch.tensor(out["ref"]), rtol=2e-2, atol=0
    )


PIPE = {"dp": 2, "pp": 2}
LORA_ALL = {"lora_rank": 4, "lora_targets": "all"}
MEMORY = [
    Case("dp2 pp2 1f1b zero2", parallel=PIPE | {"zero": 2}, accum=4),
    Case("dp2 pp2 gpipe zero3", parallel=PIPE | {"zero": 3, "schedule": "gpipe"}, accum=4),
    Case("dp2 pp2 zb-h1 zero3 always", "small-llama", accum=4,
         parallel=PIPE | {"zero": 3, "schedule": "zb-h1", "reshard_after_forward": "always"}),
    Case("dp2 pp2 interleaved zero3 always", accum=4,
         parallel=PIPE | {"zero": 3, "schedule": "interleaved", "virtual_stages": 2,
                          "reshard_after_forward": "always"}),
    Case("lora dp2 pp2 1f1b zero3", "small-llama", parallel=PIPE | {"zero": 3}, model=LORA_ALL,
         accum=4),
]  # fmt: skip


@pytest.mark.parametrize("layout", MEMORY, ids=[x.name for x in MEMORY])
def test_estimate_matches_measurement(world4, layout):
    """Model states, the frozen base and the tracked total within 2% of the memory tracker
    on every rank (the full gradient held until the step's reduce-scatter, the gathered
    stage or blocks: estimate/zero_pipeline.py)."""
    est = estimate(layout.config())
    for measured in world4.run(measure, layout):
        for term, pair in compare(est, measured).items():
            limit = 0.10 if term == "activations" else 0.02
            assert abs(error(pair)) <= limit, (layout.name, measured["pp_rank"], term, pair)


TABLE4 = [c for c in TABLE if c.world == 4]


@pytest.mark.parametrize("layout", TABLE4, ids=[x.name for x in TABLE4])
def test_memory_table_rows_on_four_ranks(world4, tmp_path, layout):
    """docs/memory.md's 4-rank rows (tests/memory_table.py) in this module's world, held as
    test_estimate_measured.py holds the 2-rank ones (every term within 2%, collectives)."""
    check_layout(world4, layout, str(tmp_path))


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"zero": 3, "pp": 2, "reshard_after_forward": "sometimes"},
         "reshard-after-forward must be one of default, always, never; got 'sometimes'"),
        ({"zero": 2, "pp": 2, "reshard_after_forward": "always"},
         "--reshard-after-forward always needs --zero 3; got zero=2"),
        ({"zero": 3, "reshard_after_forward": "never"},
         "--reshard-after-forward never needs a pipeline (pp > 1)"),
        ({"zero": 2, "pp": 2, "schedule": "2bw"}, "schedule 2bw keeps its own two weight"),
    ],
)  # fmt: skip
def test_bad_combinations_say_so(over, message):
    cfg = build_regrouped(
        "tiny-gpt", {"parallel": over, "train": {"seq_len": 32, "micro_batch": 1}}
    )
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate()


def test_the_planner_offers_and_prices_zero_2_3_under_a_pipeline():
    """`plait plan` enumerates stages 2-3 on pipelined cuts, ZeRO-3 both kept and
    regathered; regathering holds less and moves about 2m times the stage's gathers, which
    the step-time model's dp term shows."""
    model = replace(get_preset("small-gpt"), n_layers=8)  # 4 blocks a stage: 2 gathered at once
    req = Request(model, "small-gpt", 4, 4, 16, 128, "fp32", 8, None, ())
    shape = next(s for s in shapes(req) if (s.dp, s.pp, s.schedule) == (2, 2, "1f1b"))
    offered = {(c.zero, c.reshard) for c in knobs(req, shape)}
    assert {(2, "default"), (3, "default"), (3, "always")} <= offered
    kept, again = (replace(shape, zero=3, reshard=r) for r in ("default", "always"))
    assert "regather" in again.describe() and "regather" not in kept.describe()
    cfg_kept, cfg_again = config_of(req, kept), config_of(req, again)
    assert cfg_again.memory.reshard_after_forward == "always"
    assert estimate(cfg_again).most_loaded.total() < estimate(cfg_kept).most_loaded.total()
    hw = load_hardware("h100")
    t_kept, t_again = (step_time(c, hw, 4, Memo()) for c in (cfg_kept, cfg_again))
    assert t_again.dp > t_kept.dp


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--zero", "3", "--pp", "2", "--reshard-after-forward", "sometimes"],
         "reshard-after-forward must be one of default, always, never; got 'sometimes'"),
        (["--reshard-after-forward", "never", "--zero", "3"],
         "--reshard-after-forward never needs a pipeline (pp > 1)"),
    ],
)  # fmt: skip
def test_bad_reshard_is_one_line_exit_2(capsys, monkeypatch, args, message):
    """Before any worker starts: one line, exit 2."""
    monkeypatch.setenv("COLUMNS", "40")  # a narrow terminal must not wrap the line
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("plait: error: ") and err.count("\n") == 1, err


def test_checkpoints_resume_bitwise_and_across_stages(world4, tmp_path):
    """ZeRO-3 through a pipeline saved mid-run resumes bitwise in its own layout and, as
    ZeRO-2 under zb-h1, follows the uninterrupted run (rtol 1e-5): the shards are saved
    per parameter like every stage's, whatever is gathered when."""
    saved = dict(dp=2, pp=2, accum=2, par=dict(zero=3))
    full, first, ckpt = _reference(world4, saved, tmp_path / "zero3")
    rest = world4.run(_phase, saved, STEPS - AT, load=ckpt)
    assert first + rest[0]["losses"] == full["losses"]
    for name, value in _params_by_name([full]).items():
        assert torch.equal(_params_by_name(rest)[name], value), name
    other = dict(dp=2, pp=2, accum=2, par=dict(zero=2, schedule="zb-h1"))
    rest = world4.run(_phase, other, STEPS - AT, load=ckpt)
    torch.testing.assert_close(
        torch.tensor(rest[0]["losses"]), torch.tensor(full["losses"][AT:]), rtol=1e-5, atol=0
    )
