"""LoRA (base frozen, adapters trained) in every pipeline schedule equals one process exactly
(fp32): naive, GPipe, 1F1B, interleaved (2 virtual stages), ZB-H1 (whose W computes the adapters'
gradients and no base weight's), tp2 x pp2, and 2BW against its delayed single-process rule
(tests/lora_parity.py). Each rank shows the base frozen: no `.grad`, unchanged bits, moments
and buckets of its stages' adapters only; under 2BW the two weight versions share one base."""

from __future__ import annotations

import pytest
import torch

from lora_parity import lora_parity
from plait.build.model import build_model
from plait.models.declare import is_adapter
from plait.models.presets import get_preset
from plait.parallel.pipeline.split_backward import split_input_backward
from plait.parallel.pipeline.stage import run_stage, stage_params
from plait.schedule.stages import StagePlan


def _id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


def _holds_its_adapters_only(out: list[dict]) -> None:
    """Each stage's adapters (no rank holds another's), and only their bytes in the engine."""
    for rank in out:
        assert rank["states"] == 2 * rank["adapter_bytes"] > 0, rank
        assert rank["grads"] == rank["adapter_bytes"] and rank["masters"] == 0, rank


PP2 = [
    dict(preset="tiny-llama", schedule="naive", accum=2),
    dict(preset="tiny-llama", schedule="gpipe", accum=4),
    dict(preset="tiny-gpt", schedule="1f1b", accum=3, lora_dropout=0.1),
    dict(preset="tiny-gpt", schedule="interleaved", virtual_stages=2, n_layers=4, accum=4),
    dict(preset="tiny-llama", schedule="zb-h1", accum=4, lora_dropout=0.1),
    dict(preset="tiny-gpt", schedule="zb-h1", accum=2),
]


@pytest.mark.parametrize("case", PP2, ids=_id)
def test_pipelined_lora_equals_one_process(world2, case):
    out = world2.run(lora_parity, pp=2, **case)
    assert out[0]["losses"] == out[1]["losses"]
    assert not set(out[0]["adapters"]) & set(out[1]["adapters"])  # adapters live with their stage
    _holds_its_adapters_only(out)


def _two_bw_holds_one_base(out: list[dict]) -> None:
    """Adam's moments of the adapters only; the frozen base held once by both weight
    versions, the adapters twice (W(k) and W(k-1))."""
    for rank in out:
        assert rank["states"] == 2 * rank["adapter_bytes"] > 0, rank
        frozen, trained = rank["storages"]["held"]
        frozen_one, trained_one = rank["storages"]["one_copy"]
        assert frozen == frozen_one > 0 and trained == 2 * trained_one > 0, rank


def test_two_bw_lora_equals_the_delayed_rule(world2):
    cases = (dict(preset="tiny-gpt", accum=4), dict(preset="tiny-llama", accum=2, lora_dropout=0.1))
    for case in cases:
        out = world2.run(lora_parity, pp=2, schedule="2bw", steps=5, **case)
        assert out[0]["losses"] == out[1]["losses"]
        _two_bw_holds_one_base(out)


WORLD4 = [
    dict(preset="tiny-llama", schedule="1f1b", accum=4),
    dict(preset="tiny-gpt", schedule="zb-h1", accum=2, sequence_parallel=True, lora_dropout=0.1),
]


def test_tp2_pp2_lora_equals_one_process(world4):
    for case in WORLD4:
        _holds_its_adapters_only(world4.run(lora_parity, tp=2, pp=2, **case))
    out = world4.run(lora_parity, tp=2, pp=2, schedule="2bw", accum=2, preset="tiny-llama",
                     sequence_parallel=True, steps=5)  # fmt: skip
    _two_bw_holds_one_base(out)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt"])
def test_zero_bubble_w_computes_adapter_gradients_only(preset):
    """A middle stage under LoRA: the stage's parameters are its adapters; B computes the input
    gradient and no weight's, W the adapters' (equal to one plain backward) and never a base
    weight's."""
    cfg = get_preset(preset)
    cfg.n_layers, cfg.lora_rank, cfg.lora_targets = 4, 4, "all"
    model = build_model(cfg, torch.device("cpu"), seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B != 0, so A's gradient is not zero
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.copy_(torch.randn(p.shape, generator=gen))
    plan = StagePlan(stage=1, layers=range(2, 4), first=False, last=False)
    params = stage_params(model, plan)
    named = {id(p): n for n, p in model.named_parameters()}
    assert params and all(is_adapter(named[id(p)]) for p in params)
    inp = torch.randn(2, 16, cfg.d_model, generator=gen)
    grad = torch.randn(2, 16, cfg.d_model, generator=gen)

    x = inp.clone().requires_grad_()
    run_stage(model, plan, x, None).backward(grad)
    ref_in, ref = x.grad.clone(), [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)

    x = inp.clone().requires_grad_()
    grad_in, work = split_input_backward(run_stage(model, plan, x, None), grad, x, params)
    assert all(p.grad is None for p in model.parameters())  # B: no weight gradient at all
    torch.testing.assert_close(grad_in, ref_in, rtol=0, atol=0)
    work.run()
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r, rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_tp2_pp2_checkpoint_exports_to_peft_and_merged(world4, tmp_path):
    """A LoRA run saved at tp2 x pp2 (ZeRO-1): `export --format peft` loads in PEFT, and
    `export --format hf --merge` in transformers, each with the logits plait computes for the
    checkpoint (the one layout whose adapters are split both ways and held by two stages)."""
    import peft

    import in_process
    from hf_models import hf_model, llama_config, save
    from plait.cli import main
    from test_lora_peft import ATOL, RTOL, RUN, logits, plait_checkpoint_logits

    base = save(llama_config(), tmp_path / "base")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Adapters split by tp and pp, exported whole. " * 40)
    run = tmp_path / "run"
    code, err = in_process.train(world4, ["--init-from", str(base), "--data", str(corpus),
                                          "--out", str(run), *RUN, "--lora-rank", "4",
                                          "--lora-targets", "all", "--tp", "2", "--pp", "2",
                                          "--zero", "1", "--lr", "1e-2"])  # fmt: skip
    assert code == 0, err[-3000:]
    ours = plait_checkpoint_logits(base, run)
    assert (ours - logits(hf_model(base))).abs().max() > 1e-4  # the adapters moved it
    for fmt in (["--format", "peft"], ["--format", "hf", "--merge"]):
        out = tmp_path / fmt[1]
        assert main(["export", "--checkpoint", str(run), *fmt, "--out", str(out)]) == 0
        model = (peft.PeftModel.from_pretrained(hf_model(base), out) if fmt[1] == "peft"
                 else hf_model(out))  # fmt: skip
        torch.testing.assert_close(logits(model.eval()), ours, rtol=RTOL, atol=ATOL)
