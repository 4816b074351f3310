"""`plait estimate --base-dtype nf4` prices the base as QLoRA holds it, and `plait plan` weighs
it: LLaMA-7B's NF4 base is 3.87 GB (QLoRA's figure; the blocks' Linear weights at 4.127 bits,
embeddings, head and norms in bf16), so a 7B LoRA run that does not fit a 12 GiB card with a
bf16 base fits with an NF4 one; the planner offers an NF4 base only the layouts that hold it
(ZeRO 0-3, no 2BW, tensor-parallel cuts on whole 64-blocks). No process starts. (Estimated
against measured: tests/test_lora_estimate.py's qlora rows.)"""

from __future__ import annotations

import json
from dataclasses import replace

from plait.cli import main
from plait.models.presets import get_preset
from plait.plan.enumerate import Request, knobs, shapes

LLAMA_7B = ["--model", "llama-7b", "--lora-rank", "64", "--lora-targets", "all",
            "--precision", "bf16", "--micro-batch", "1", "--global-batch", "1",
            "--seq-len", "512"]  # fmt: skip


def _reference(capsys, base: str) -> dict:
    assert main(["estimate", *LLAMA_7B, "--base-dtype", base, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["reference"]


def test_llama_7b_nf4_base_is_qloras_figure(capsys) -> None:
    nf4, bf16 = _reference(capsys, "nf4"), _reference(capsys, "bf16")
    adapters = nf4["lora_phi"] * nf4["lora_bytes_per_adapter_param"]
    base = nf4["lora_one_gpu"] - adapters
    h, f, layers = 4096, 11008, 32
    weights = [h * h] * 4 + [h * f] * 3  # q, k, v, o; gate, up, down
    quantized = layers * sum(weights)
    held = layers * sum(n // 2 + n // 64 + 4 * -(-(n // 64) // 256) + 4 for n in weights)
    assert base == held + 2 * (nf4["psi"] - quantized)  # the rest (embeddings, norms) in bf16
    assert round(base / 1e9, 2) == 3.87  # QLoRA: the 4-bit LLaMA-7B
    assert bf16["lora_one_gpu"] - adapters == 2 * bf16["psi"]  # 13.48 GB
    assert nf4["lora_phi"] == 159_907_840  # rank 64 on every Linear: 0.32 GB in bf16


def _plan(base: str, capsys) -> tuple[int, str]:
    code = main(["plan", *LLAMA_7B[:6], "--base-dtype", base, "--precision", "bf16",
                 "--gpus", "1", "--gpu-memory", "12GiB", "--global-batch", "4",
                 "--seq-len", "512"])  # fmt: skip
    out = capsys.readouterr()
    return code, out.out + out.err


def test_plan_fits_a_7b_on_12_gib_with_an_nf4_base_only(capsys) -> None:
    code, text = _plan("bf16", capsys)
    assert code == 2 and "nothing fits" in text and "largest term frozen_base" in text
    code, text = _plan("nf4", capsys)
    assert code == 0 and "dp1 tp1 pp1" in text


def test_plan_offers_nf4_only_what_holds_it() -> None:
    model = get_preset("small-llama")
    model.lora_rank, model.lora_targets, model.n_kv_heads = 4, "all", 4  # tp 4 splits the heads
    req = Request(model, "small-llama", 8, 8, 16, 128, "fp32", 8, None, (), base_dtype="nf4")
    found = [k for shape in shapes(req) for k in knobs(req, shape)]
    assert found and {c.zero for c in found} == {0, 1, 2, 3}
    assert all(c.schedule != "2bw" for c in found)
    # d_model 128: attn.wo splits into whole 64-column blocks over tp 2, not over tp 4
    assert {c.tp for c in found} == {1, 2}
    auto = replace(req, base_dtype="auto")
    every = [k for shape in shapes(auto) for k in knobs(auto, shape)]
    assert {c.tp for c in every} == {1, 2, 4} and any(c.schedule == "2bw" for c in every)
