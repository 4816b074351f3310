"""Packed attention by mode: time and saved bytes of the dense mask against attention by
document (models/packed_attention.py), on rows of 2k and 8k tokens.

    .venv/bin/python benchmarks/bench_packed_attention.py \
        --json benchmarks/results/packed_attention.json

For each row length, one packed row (b = 1) whose documents are fixed by a seed (2,048 tokens:
the issue's 512/300/700/536; 8,192: lengths drawn from 64..2,048 until the row is full, the
rest padding), and two measurements per mode, the modes alternating round by round:

1. The attention core alone, as a layer runs it: q, k, v (1, a, s, hd) made by one product
   (so they are activations), attention, then a product with a trainable weight (so its input,
   the attention output, is saved as the output projection saves it); forward and backward.
2. The model's training pass: `--model`'s forward with packed segments and its backward.

Each: the median wall time over `--rounds` (after a warm-up) and the bytes autograd saves
for backward (plait's memory tracker: its peak over the pass, each storage once). Modes:
mask and per-document everywhere; varlen on CUDA in bf16 (`--device cuda`). fp32 on CPU,
`--threads` torch threads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median
from output import machine_line, markdown_table, publish
from plait.build.model import build_model
from plait.device import device_kind
from plait.memory_tracker import MemoryTracker
from plait.models.packing import Packing
from plait.models.presets import get_preset

ISSUE_ROW = (512, 300, 700, 536)  # the 2,048-token row of issue 33's measurement


def documents(seq: int, seed: int) -> list[int]:
    """Document lengths filling a row of `seq` (the last, shorter run is padding)."""
    if seq == sum(ISSUE_ROW):
        return list(ISSUE_ROW)
    gen, out = torch.Generator().manual_seed(seed), []
    while sum(out) < seq:
        out.append(min(int(torch.randint(64, 2049, (1,), generator=gen)), seq - sum(out)))
    return out


def segments_of(lengths: list[int], device: torch.device) -> torch.Tensor:
    ids = [torch.full((n,), i) for i, n in enumerate(lengths)]
    return torch.cat(ids).unsqueeze(0).to(device)  # (1, s)


def measured(fn) -> tuple[float, int]:
    """Seconds of fn() (forward and backward) and the bytes it saved at most."""
    tracker = MemoryTracker()
    with tracker.activations():
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return seconds, tracker.peak("activations")


def core_pass(pack: Packing, heads: int, head_dim: int, dtype: torch.dtype):
    """One attention core's forward and backward over `pack`'s row, as a layer runs it."""
    s, device = pack.runs.shape[1], pack.runs.device
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, s, 64, device=device, dtype=dtype, generator=gen)
    w_in = torch.randn(64, 3 * heads * head_dim, device=device, dtype=dtype, generator=gen)
    w_out = torch.randn(heads * head_dim, 64, device=device, dtype=dtype, generator=gen)
    w_in.requires_grad_(), w_out.requires_grad_()

    def run() -> None:
        qkv = (x @ w_in).view(1, s, 3, heads, head_dim)  # (1, s, 3, a, hd)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (1, a, s, hd)
        bound = pack.bound(q, explicit=False)
        if isinstance(bound, Packing):
            y = bound.attend(q, k, v)
        else:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bound)
        (y.transpose(1, 2).reshape(1, s, -1) @ w_out).sum().backward()

    return run


def model_pass(model, tokens: torch.Tensor, segments: torch.Tensor, mode: str):
    def run() -> None:
        model.packed_attention = mode
        model(tokens, tokens.roll(-1, 1), segments=segments).backward()
        model.zero_grad(set_to_none=True)

    return run


def bench_row(args, seq: int, device: torch.device, modes: list[str]) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths = documents(seq, args.seed)
    segments = segments_of(lengths, device)
    cfg = get_preset(args.model)
    cfg.max_seq_len = max(cfg.max_seq_len, seq)
    model = build_model(cfg, device, seed=0).to(dtype)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq), device=device)
    passes = {}
    for mode in modes:
        pack = Packing.of(segments, mode)
        passes[mode] = {
            "core": core_pass(pack, args.heads, args.head_dim, dtype),
            "model": model_pass(model, tokens, segments, mode),
        }
    times = {(m, w): [] for m in modes for w in ("core", "model")}
    saved: dict[tuple[str, str], int] = {}
    for r in range(args.warmup + args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            for what, fn in passes[mode].items():
                seconds, saved[mode, what] = measured(fn)
                if r >= args.warmup:
                    times[mode, what].append(seconds)
    work = sum(n * n for n in lengths) / seq**2
    figures = {m: {w: {"median_ms": median(times[m, w]) * 1e3, "saved_bytes": saved[m, w],
                       "times_ms": [x * 1e3 for x in times[m, w]]} for w in ("core", "model")}
               for m in modes}  # fmt: skip
    return {"seq": seq, "documents": lengths, "work_ratio": work, "modes": figures}


def report(res: dict[str, Any], threads: int) -> str:
    rows = []
    for row in res["rows"]:
        base = row["modes"]["mask"]
        for mode, fig in row["modes"].items():
            for what in ("core", "model"):
                f, b = fig[what], base[what]
                speed = f"{b['median_ms'] / f['median_ms']:.2f}x"
                share = f"{f['saved_bytes'] / b['saved_bytes']:.3f}"
                rows.append([row["seq"], what, mode, f["median_ms"], speed,
                             f"{f['saved_bytes']:,}", share])  # fmt: skip
    head = ["tokens", "pass", "mode", "median ms", "speed vs mask", "saved bytes", "vs mask"]
    docs = "; ".join(
        f"{r['seq']}: {len(r['documents'])} runs, Σl²/s² {r['work_ratio']:.3f}" for r in res["rows"]
    )
    what = f"model {res['model']}; core a={res['heads']}, hd={res['head_dim']}; rows: {docs}"
    title = "# Packed attention by mode"
    parts = [title, machine_line(res, threads, per_rank=False), what, markdown_table(head, rows)]
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="2048,8192", help="row lengths, comma-separated")
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--heads", type=int, default=8, help="the core pass's heads")
    ap.add_argument("--head-dim", type=int, default=64, help="the core pass's head size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(device_kind(args.device))
    modes = ["mask", "per-document"] + (["varlen"] if device.type == "cuda" else [])
    rows = [bench_row(args, int(s), device, modes) for s in args.seqs.split(",")]
    res = {"machine": machine(), "model": args.model, "heads": args.heads,
           "head_dim": args.head_dim, "device": device.type, "rows": rows}  # fmt: skip
    publish(res, report(res, args.threads), args.json)


if __name__ == "__main__":
    main()
