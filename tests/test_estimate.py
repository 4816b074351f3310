"""The memory estimator's formulas, without processes: parameter counts, the course figures,
ZeRO stages, activations per recompute mode and sequence parallelism, in-flight micro-batches
per schedule from the simulator, and `plait estimate` on good and bad input."""

from __future__ import annotations

import json

import pytest

from plait.cli import main
from plait.estimate import estimate
from plait.estimate.activations import MicroShape, layer_bytes
from plait.estimate.formulas import korthikanti_layer_bytes
from plait.estimate.rank_params import total_parameters
from plait.models.presets import get_preset, preset_names
from plait.models.transformer import count_parameters
from plait.schedule.schedules import build_schedule
from plait.schedule.simulate import simulate
from sections import build_regrouped

LLAMA_7B, LLAMA_65B = 6_738_415_616, 65_285_660_672


def _cfg(preset: str = "small-gpt", **parallel):
    train = parallel.pop("train", {})
    cfg = build_regrouped(preset, {"parallel": parallel, "train": train})
    cfg.validate()
    return cfg


@pytest.mark.parametrize("name", preset_names())
def test_parameter_count_without_a_model_equals_the_models(name):
    assert total_parameters(get_preset(name)) == count_parameters(get_preset(name))


def test_course_figures():
    cfg = _cfg("llama-7b", precision="bf16", train={"micro_batch": 1, "global_batch": 1})
    est = estimate(cfg)
    assert est.psi == LLAMA_7B
    assert est.ranks[0].model_states() == 16 * LLAMA_7B == 107_814_649_856  # the "112 GB"
    assert est.reference["mixed_precision_adam_16psi"] == 107_814_649_856
    ref = estimate(_cfg("llama-65b", train={"micro_batch": 1, "global_batch": 1})).reference
    assert ref["bf16_finetune_12psi"] == 12 * LLAMA_65B == 783_427_928_064
    assert round(ref["bf16_finetune_12psi"] / 1e9, 1) == 783.4  # QLoRA's "> 780 GB"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_reduce_to_the_papers_closed_forms(stage):
    n, psi = 8, LLAMA_7B
    train = {"micro_batch": 1, "global_batch": n}
    est = estimate(_cfg("llama-7b", dp=n, zero=stage, precision="bf16", train=train))
    paper = {1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
    assert est.ranks[0].model_states() == pytest.approx(paper, rel=1e-6)  # padding only
    assert est.reference[f"zero{stage}_per_rank"] == paper


def test_offload_moves_master_and_moments_off_the_device(tmp_path):
    cpu = estimate(_cfg(dp=2, zero=2, offload="cpu")).ranks[0]
    assert cpu.line("optimizer_states").device == 0 and cpu.line("optimizer_states").host > 0
    assert cpu.line("master_weights").host == cpu.line("optimizer_states").host // 2
    nvme = estimate(_cfg(dp=2, zero=1, offload="nvme", offload_dir=str(tmp_path))).ranks[0]
    assert nvme.line("optimizer_states").disk == cpu.line("optimizer_states").host
    assert nvme.line("master_weights").host > 0  # one staging sub-group in host memory


def test_activations_per_recompute_mode_and_sequence_parallel():
    m = get_preset("small-llama")
    m.dropout = 0.1  # the explicit attention path: the s^2 terms exist
    b, s, a, e = 2, 64, m.n_heads, 2
    x = MicroShape(b, s, 1, False, e)
    none, sel, full = (layer_bytes(m, x, mode) for mode in ("none", "selective", "full"))
    assert full == s * b * m.d_model * e  # only the block input (Korthikanti: 2sbh)
    assert none - sel == s * s + b * a * s * s * (4 + 1 + e)  # softmax fp32, mask, dropped
    sp = MicroShape(b, s, 2, True, e)
    assert layer_bytes(m, sp, "full") == full // 2  # the block input is sequence-sharded
    tp = MicroShape(b, s, 2, False, e)
    assert layer_bytes(m, sp, "none") < layer_bytes(m, tp, "none") < none
    # the paper's figure for the same layer: plait differs (fp32 softmax, SwiGLU, RMSNorm)
    paper = korthikanti_layer_bytes(s, b, m.d_model, a)
    assert 0.5 < none / paper < 2


@pytest.mark.parametrize(
    ("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
)
def test_in_flight_micro_batches_come_from_the_simulator(schedule, v):
    p, m = 2, 4
    cfg = _cfg(pp=p, schedule=schedule, virtual_stages=v, train={"global_batch": 8 * m})
    est = estimate(cfg)
    sim = simulate(build_schedule(schedule, p, m, v))
    assert tuple(r.in_flight for r in est.ranks) == sim.peak_in_flight
    expect = {"gpipe": (m, m), "1f1b": (2, 1), "zb-h1": (2, 1)}.get(schedule)
    if expect:
        assert sim.peak_in_flight == expect


def test_pipeline_stage_activations_scale_with_the_schedule():
    gpipe = estimate(_cfg(pp=2, schedule="gpipe", train={"global_batch": 32})).ranks[1]
    one = estimate(_cfg(pp=2, schedule="1f1b", train={"global_batch": 32})).ranks[1]
    assert gpipe.line("activations").device == 4 * one.line("activations").device
    assert one.line("pipeline_buffers").device > 0


def test_cli_prints_a_table_and_json(capsys):
    assert main(["estimate", "--model", "llama-7b", "--precision", "bf16", "--micro-batch",
                 "1", "--global-batch", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "107,814,649,856" in out and "(75.308 GiB)" in out and "optimizer_states" in out
    assert " GB" not in out  # one unit family: binary, like the table's columns
    assert main(["estimate", "--dp", "2", "--zero", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)  # JSON only
    assert data["psi"] == 858_880 and data["ranks"][0]["total"]["device"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3"], "model.n_heads=4 is not divisible by tp=3"),
        (["--pp", "8"], "more pipeline stages (pp x virtual stages = 8) than layers (4)"),
        (["--pp", "2", "--stage-layers", "3,2"], "stage layer counts [3, 2] must be 2 numbers"),
        (["--device-memory", "0.001"], "nothing fits: pipeline stage 0 needs 0.05 GiB"),
        (["--dp", "2", "--dp-mode", "naive"], "the estimator models dp_mode ddp; dp_mode naive"),
    ],
)
def test_bad_input_is_one_line_naming_the_values(argv, message, capsys):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
