"""Every layout of each Llama-like family equals one process (fp32, tests/family_parity.py):
tp2 with sequence parallelism (Qwen2's q/k/v biases split with their rows, Qwen3's per-head
q/k norms replicated with a tp-partial gradient, Phi-3's fused projections as separate
Linears), pp2 (a tied head on the last stage: Llama 3.2, Qwen), dp2 with ZeRO-3, and LoRA on
every Linear of the block (the family's PEFT target names) at tp2 and under ZeRO-3."""

from __future__ import annotations

import pytest

from family_parity import family_parity

FAMILIES = ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-phi3"]
LAYOUTS = {
    "tp2-sp": dict(tp=2, sp=True, lora=False),
    "pp2": dict(pp=2, accum=2, lora=False),
    "dp2-zero3": dict(dp=2, zero=3, lora=False),
    "lora-tp2-sp": dict(tp=2, sp=True, lora=True),
    "lora-dp2-zero3": dict(dp=2, zero=3, lora=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("preset", FAMILIES)
def test_family_layout_equals_one_process(world2, preset: str, layout: str) -> None:
    names = world2.run(family_parity, preset, **LAYOUTS[layout])
    held = set(names[0]) | set(names[1])
    if preset == "tiny-qwen3":
        assert {"blocks.0.attn.q_norm.weight", "blocks.1.attn.k_norm.weight"} <= held
    if preset == "tiny-qwen2":
        assert "blocks.0.attn.wk.bias" in held and "blocks.0.attn.wo.bias" not in held
    if preset == "tiny-phi3" and LAYOUTS[layout]["lora"]:  # gate_up_proj: one A for both
        assert "blocks.0.mlp.w_gate.lora_a" in held and "blocks.0.mlp.w_up.lora_a" not in held
