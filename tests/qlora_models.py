"""QLoRA on both sides, for the PEFT parity tests (no tests here): a Llama saved 4-bit by
transformers, PEFT's `Linear4bit` LoRA on it, and plait's model over the same NF4 bytes.

`dtype` is what transformers loads (and so quantizes from) and what the NF4 products compute
in (`bnb_4bit_compute_dtype`): fp32 (tests/test_nf4_peft.py) or bf16 with PEFT's fp32 upcast
of everything else (`prepare_model_for_kbit_training`; tests/test_nf4_upcast.py), which
plait runs with `--base-upcast`.
"""

from __future__ import annotations

from pathlib import Path

import peft
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from plait.memory_tracker import MemoryTracker
from plait.models.architecture import ModelConfig
from plait.models.contract import contract_of
from plait.models.declare import is_adapter
from plait.models.hf.load import hf_source, load_config
from plait.models.init import with_adapters
from plait.models.nf4.source import nf4_source
from plait.models.transformer import Transformer
from plait.parallel.zero.nf4_base import hold_nf4, nf4_targets

RANK, ALPHA = 4, 16.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CPU = torch.device("cpu")


def save_4bit(full: Path, out: Path, dtype: torch.dtype) -> Path:
    """`full` (a Hugging Face folder) loaded 4-bit by transformers (NF4, double
    quantization, products in `dtype`) and saved so."""
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )
    model = AutoModelForCausalLM.from_pretrained(full, quantization_config=quant, dtype=dtype)
    model.save_pretrained(out)
    return out


def peft_qlora(folder: Path, dtype: torch.dtype = torch.float32):
    """PEFT's QLoRA on the 4-bit folder: Linear4bit bases, adapters on every Linear, the
    rest upcast to fp32 by `prepare_model_for_kbit_training`."""
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS,
                             task_type="CAUSAL_LM")  # fmt: skip
    return peft.get_peft_model(base, config)


def qlora_config(folder: Path) -> ModelConfig:
    cfg = load_config(folder)
    cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets = RANK, ALPHA, "all"
    cfg.validate()
    return cfg


def plait_qlora(
    folder: Path,
    cfg: ModelConfig,
    adapters: dict[str, torch.Tensor],
    products: torch.dtype | None = None,
):
    """plait's model over the folder's NF4 weights (held as the engine holds them), fp32
    everywhere but the NF4 products (in `products`; None: fp32)."""
    model = Transformer(cfg)
    source = with_adapters(hf_source(folder, cfg), cfg, 0, lambda name, s, sh: adapters[name])
    quantized = {entry.name for entry, _ in nf4_targets(model)}
    with torch.no_grad():
        for entry, p in contract_of(model).bind(model):
            if entry.name not in quantized:
                p.copy_(source(entry.name, tuple(p.shape), None))
    held = hold_nf4(model, nf4_source(cfg, 0, str(folder)), CPU, MemoryTracker(CPU), products)
    return model, held


def random_adapters(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Transformer(cfg).named_parameters() if is_adapter(n)}
    return {n: torch.randn(s, generator=gen) * 0.1 for n, s in shapes.items()}


def peft_tensors(model, what) -> dict[str, torch.Tensor]:
    return {n.replace(".default", ""): what(p) for n, p in model.named_parameters()
            if p.requires_grad}  # fmt: skip
