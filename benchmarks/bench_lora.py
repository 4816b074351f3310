"""LoRA: plait against transformers + peft with a plain PyTorch loop (one process), and plait at
dp 2 with ZeRO-2 and ZeRO-3 against DistributedDataParallel + peft.

    .venv/bin/python benchmarks/bench_lora.py --json benchmarks/results/lora.json

1. A LLaMA-shaped base with seeded weights is written as a Hugging Face folder (`--layers`,
   `--hidden`, ...; byte vocabulary, so plait's default corpus trains it).
2. Every side starts from that folder and the same adapters: plait's Trainer (`--init-from`,
   `--lora-rank`, `--lora-targets all`) draws its initial A (B is zero), and the peft side
   (`peft.get_peft_model` on `AutoModelForCausalLM.from_pretrained`, same rank, alpha and
   targets) is given those A and B (`plait.models.hf.peft.adapter_tensors`). Both step on the
   same batches (the Trainer's sampler, mirrored), AdamW with the same hyper-parameters at a
   constant learning rate and the same clipping, so the losses agree step by step: the
   table's |Δloss| is the check that both did the same work.
3. After warm-up, rounds alternate a block of steps of each side (the order flips every
   round); the figure is the median step time and the median of per-round ratios.
4. Memory per rank: model states (parameters, gradients, optimizer states, as held) and the
   bytes autograd saves for backward in one step (the most held at once, counted per storage
   by a saved-tensor hook on both sides). Bytes per step: plait's own counts of its collectives
   (`Comm.stats`), DDP's gradient buckets by a communication hook.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Side,
    alternate,
    loss_diffs,
    machine,
    max_over_ranks,
    pair_ratios,
    spawn,
    step_figures,
    threads_for,
    usable_cores,
)
from lora_sides import PeftSide, TrainerSide, base_folder, lora_config, plait_config
from output import machine_line, markdown_table, publish
from plait.mesh import build_mesh, single_process_mesh
from plait.topology import Layout
from plait.train import Trainer


def timed_step(side: Side) -> tuple[float, dict[str, Any]]:
    """One optimizer step of either side on the same global batch, max over ranks."""
    idx = side.mirror.next_batch()  # before the clock: drawing indices is not the step
    start = time.perf_counter()
    side.losses.append(side.step(idx))
    seconds = time.perf_counter() - start
    return (max_over_ranks(seconds) if dist.is_initialized() else seconds), {}


def figures(side: Side) -> dict[str, Any]:
    return {**step_figures(side), **side.memory(), "bytes_per_step": side.bytes_per_step}


def compare(pairs: list[tuple[Side, Side]], opts: argparse.Namespace) -> dict[str, Any]:
    """Warm-up and alternating rounds of each (plait, peer) pair; figures and ratios."""
    for side in [s for pair in pairs for s in pair]:  # the same order on every rank
        side.measure_memory()  # one metered step each, outside the timed rounds
    alternate(pairs, timed_step, warmup=opts.warmup, rounds=opts.rounds, steps=opts.steps)
    out: dict[str, Any] = {}
    for a, b in pairs:
        out[f"{a.name} vs {b.name}"] = {
            a.name: figures(a),
            b.name: figures(b),
            "ratio": pair_ratios(a, b),
            "max_loss_diff": max(loss_diffs(a, b), default=float("nan")),
        }
    return out


def single(opts: argparse.Namespace, folder: Path) -> dict[str, Any]:
    torch.set_num_threads(opts.threads or usable_cores())
    trainer = Trainer(plait_config(opts, folder, dp=1, zero=0), single_process_mesh())
    plait = TrainerSide("plait", trainer)
    peer = PeftSide("peft", folder, trainer, opts, ddp=False)
    return compare([(plait, peer)], opts)


def worker(rank: int, world: int, opts: argparse.Namespace, folder: Path) -> dict[str, Any]:
    torch.set_num_threads(threads_for(world))
    mesh = build_mesh(Layout(dp=world), torch.device("cpu"))
    sides = {z: TrainerSide(f"plait-zero{z}", Trainer(plait_config(opts, folder, world, z), mesh))
             for z in (2, 3)}  # fmt: skip
    peers = {z: PeftSide(f"ddp+peft ({z})", folder, sides[z].trainer, opts, ddp=True)
             for z in (2, 3)}  # fmt: skip
    res = compare([(sides[z], peers[z]) for z in (2, 3)], opts)
    return res if rank == 0 else {}


def run(opts: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="plait-bench-lora-"))
    try:
        folder = base_folder(root, opts)
        res = {"single": single(opts, folder)}
        if opts.world > 1:
            res["dp"] = spawn(worker, opts.world, opts, folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"machine": machine(), "config": vars(opts), **res}


def report(res: dict[str, Any]) -> str:
    c = res["config"]
    head = ["side", "median step ms", "ratio (paired)", "model states MiB", "activations MiB",
            "trainable params", "bytes/step", "max |Δloss|"]  # fmt: skip
    rows = []
    for part in ("single", "dp"):
        for pair, r in res.get(part, {}).items():
            a, b = pair.split(" vs ")
            for name in (a, b):
                f = r[name]
                ratio = f"{r['ratio']['paired_block_ratio']:.2f}" if name == a else ""
                rows.append([name, f"{f['median_ms']:.1f}", ratio, f"{f['states'] / 2**20:.2f}",
                             f"{f['activations'] / 2**20:.2f}", f"{f['trainable']:,}",
                             f"{f['bytes_per_step']:,}", f"{r['max_loss_diff']:.1e}"])  # fmt: skip
    return "\n".join([
        f"### LoRA r={c['rank']} alpha={c['alpha']} on q,k,v,o,gate,up,down: LLaMA-shaped "
        f"{c['layers']} layers, hidden {c['hidden']}, seq {c['seq_len']}, global batch "
        f"{c['global_batch']} (micro {c['micro_batch']}); dp {c['world']} for the second pair",
        "",
        machine_line(res, c["threads"] or usable_cores(), per_rank=False),
        "",
        markdown_table(head, rows),
    ])  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    lora_config(p)
    p.add_argument("--world", type=int, default=2, help="dp ranks of the second pair (1: skip)")
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
