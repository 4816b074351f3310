"""QLoRA: plait (`--base-dtype nf4`) against transformers + PEFT + bitsandbytes (`load_in_4bit`,
`prepare_model_for_kbit_training`, LoRA on every Linear) in a plain PyTorch loop, one process.

    .venv/bin/python benchmarks/bench_qlora.py --json benchmarks/results/qlora.json

1. A LLaMA-shaped base with seeded weights is written as a Hugging Face folder, then loaded
   4-bit by transformers (NF4, double quantization, fp32 compute) and saved: both sides read
   that 4-bit folder as it is, so they hold bitsandbytes' own bytes.
2. The same adapters (plait's initial A and B, given to PEFT), the same batches, AdamW and
   clipping (benchmarks/lora_sides.py): the losses agree step by step (|Δloss|). fp32 compute:
   the arithmetic tests/test_nf4_peft.py holds exact (no `--base-upcast`; under fp32 the two
   are the same).
3. Alternating rounds after warm-up: median step time and the median of per-round ratios.
4. Memory: model states as held (plait's tracker; PEFT's side: every parameter, the 4-bit
   weights' absmax codes, nested scales and offsets, the adapters' gradients and AdamW's
   moments) and the bytes autograd saves for backward in one micro-batch.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lora import compare
from common import machine, usable_cores
from lora_sides import PeftSide, TrainerSide, base_folder, lora_config, plait_config
from output import machine_line, markdown_table, publish
from plait.mesh import single_process_mesh
from plait.train import Trainer

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # a missing optional CPU kernel


def four_bit(folder: Path, out: Path) -> Path:
    """`folder` loaded 4-bit by transformers (NF4, double quantization, fp32) and saved."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant,
                                         dtype=torch.float32).save_pretrained(out)  # fmt: skip
    return out


def peft_base(folder: Path) -> Any:
    """PEFT's QLoRA base: the 4-bit folder, `prepare_model_for_kbit_training`."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def quant_state_bytes(model: torch.nn.Module) -> int:
    """What bitsandbytes keeps beside each 4-bit weight's packed codes, as plait counts its
    own (models/nf4/format.held_bytes): the 8-bit absmax codes, the nested fp32 scales and
    the offset (the shared tables left out)."""
    total = 0
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            total += state.absmax.numel() * state.absmax.element_size() + 4
            total += state.state2.absmax.numel() * state.state2.absmax.element_size()
    return total


class QPeftSide(PeftSide):
    """PEFT's QLoRA in train mode (in eval mode on a CPU with AVX512-BF16 bitsandbytes
    repacks its weights for an inference kernel); its model states add the 4-bit weights'
    constants."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model.train()

    def measure_memory(self) -> None:
        super().measure_memory()
        self.figures["states"] += quant_state_bytes(self.model)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(opts.threads or usable_cores())
    root = Path(tempfile.mkdtemp(prefix="plait-bench-qlora-"))
    try:
        folder = four_bit(base_folder(root, opts), root / "nf4")
        cfg = plait_config(opts, folder, dp=1, zero=0, base_dtype="nf4")
        trainer = Trainer(cfg, single_process_mesh())
        plait = TrainerSide("plait nf4", trainer)
        peer = QPeftSide("peft + bitsandbytes", folder, trainer, opts, ddp=False, load=peft_base)
        res = {"single": compare([(plait, peer)], opts)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"machine": machine(), "config": vars(opts), **res}


def report(res: dict[str, Any]) -> str:
    c = res["config"]
    head = ["side", "median step ms", "ratio (paired)", "model states MiB", "activations MiB",
            "trainable params", "max |Δloss|"]  # fmt: skip
    rows = []
    for pair, r in res["single"].items():
        a, b = pair.split(" vs ")
        for name in (a, b):
            f = r[name]
            ratio = f"{r['ratio']['paired_block_ratio']:.2f}" if name == a else ""
            rows.append([name, f"{f['median_ms']:.1f}", ratio, f"{f['states'] / 2**20:.2f}",
                         f"{f['activations'] / 2**20:.2f}", f"{f['trainable']:,}",
                         f"{r['max_loss_diff']:.1e}"])  # fmt: skip
    return "\n".join([
        f"### QLoRA r={c['rank']} alpha={c['alpha']} on q,k,v,o,gate,up,down over an NF4 base "
        f"(fp32 compute): LLaMA-shaped {c['layers']} layers, hidden {c['hidden']}, seq "
        f"{c['seq_len']}, global batch {c['global_batch']} (micro {c['micro_batch']})",
        "",
        machine_line(res, c["threads"] or usable_cores(), per_rank=False),
        "",
        markdown_table(head, rows),
    ])  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    lora_config(p)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3, help="steps per block")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: usable cores)")
    p.add_argument("--json", help="save the results here")
    opts = p.parse_args()
    res = run(opts)
    publish(res, report(res), opts.json)


if __name__ == "__main__":
    main()
