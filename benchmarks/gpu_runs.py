"""The runs `gpu_check.py` times and meters: the configs (a 1.1B LLaMA in bf16, a tiny one in
fp32), one in-process run of N steps with the allocator's peak split at the end of the
micro-batches, and the figures drawn from a run (tokens/s, MFU, the peak against the
estimate). Kept apart from the checks so each file holds one concern."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from plait.config import Config, build_config
from plait.device import peak_allocated_bytes, peak_flops, reset_peak, synchronize
from plait.estimate import estimate
from plait.mesh import build_mesh
from plait.models.transformer import matmul_flops_per_token
from plait.train import Trainer

# TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 heads over 4 KV heads, SwiGLU 5632,
# vocabulary 32,000): a 1B-class model whose full AdamW states fit one 80 GB card.
ONE_B = dict(
    n_layers=22, d_model=2048, n_heads=32, n_kv_heads=4, ffn_hidden=5632,
    vocab_size=32000, max_seq_len=2048,
)  # fmt: skip
SEQ, MICRO, GLOBAL = 2048, 2, 8  # 4 micro-batches of 2 x 2048 tokens per step
# torchtitan's published single-node figure (docs/performance.md there): Llama 3.1 8B on 8
# H100s (FSDP, local batch 2, selective activation checkpointing, bf16, no torch.compile).
TORCHTITAN = "Llama-3.1-8B, 8xH100, FSDP bf16: 5,762 tokens/s/GPU, 33-39% MFU"


def one_b_config(
    steps: int, memory: dict[str, Any] | None = None, device: str = "cuda", **train: Any
) -> Config:
    """The 1.1B model's config; `memory` ([memory]) and `train` ([train]) add to the
    defaults."""
    base = {"steps": steps, "micro_batch": MICRO, "global_batch": GLOBAL, "seq_len": SEQ}
    base |= {"eval_every": 0, "precision": "bf16", "device": device}
    optim = {"lr": 4e-4, "min_lr": 4e-5, "warmup_steps": 2}  # TinyLlama's peak rate
    data = {"max_bytes": 4_000_000}
    if "data" in train:
        data["path"] = train.pop("data")
    over = {"model": dict(ONE_B), "memory": memory or {}, "data": data, "optim": optim}
    return _config("llama-7b", over | {"train": base | train})


def tiny_config(device: str, steps: int) -> Config:
    """The parity check's tiny LLaMA in fp32."""
    train = {"steps": steps, "micro_batch": 4, "global_batch": 8, "seq_len": 128}
    train |= {"eval_every": 0, "precision": "fp32", "device": device}
    return _config("small-llama", {"data": {"max_bytes": 400_000}, "train": train})


def _config(preset: str, over: dict[str, dict[str, Any]]) -> Config:
    log = {"progress": False, "out": "/tmp/plait-gpu-check-unused"}
    cfg = build_config(preset, over | {"log": log})
    cfg.validate()
    return cfg


def run_steps(
    cfg: Config, device: torch.device, params: bool = False, meter: bool = False
) -> dict[str, Any]:
    """Train `cfg.train.steps` steps in this process on `device`; the first two are warm-up.
    Returns losses, median step time, the allocator's peak from step 2 on (whole step, and
    split at the end of the micro-batches: forward and backward, then the gradient norm,
    clipping and the optimizer), the tracker's, and (`params`) the trained parameters on the
    CPU in fp32. `meter`: count the bytes saved for backward from step 2 on (device and
    host), at the meter's cost in time."""
    mesh = build_mesh(cfg.parallel.layout, device, 300)
    trainer = Trainer(cfg, mesh)
    phases = _phase_peaks(trainer, device)
    losses, times = [], []
    for k in range(cfg.train.steps):
        phases["on"] = k >= 2
        reset_peak(device)
        synchronize(device)
        t0 = time.perf_counter()
        losses.append(trainer.train_step(meter_activations=meter and k >= 2).loss)
        synchronize(device)
        times.append(time.perf_counter() - t0)
        if phases["on"]:
            phases["optimizer"] = max(phases["optimizer"], peak_allocated_bytes(device) or 0)
    memory = trainer.engine.memory
    out = {
        "losses": losses,
        "step_s": statistics.median(times[2:] or times),
        "allocator_peak": max(phases["micro_batches"], phases["optimizer"]) or None,
        "peak_micro_batches": phases["micro_batches"],
        "peak_optimizer": phases["optimizer"],
        "tracked_peak": memory.peak() if memory else None,
        "host_peak": memory.peak(place="host") if memory else None,
        "saved_device": memory.peak("activations") if memory else None,
        "saved_host": memory.peak("activations", "host") if memory else None,
    }
    if params:
        out["params"] = {n: p.detach().float().cpu() for n, p in trainer.model.named_parameters()}
    del trainer.engine.finish  # the wrapper refers to the engine: no cycle outlives the run
    trainer.close()
    del trainer
    release(device)
    return out


def release(device: torch.device) -> None:
    """Free what a finished run left for the garbage collector (hooks and closures can hold a
    model in reference cycles) and hand the cache back, so the next run's peak is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _phase_peaks(trainer: Trainer, device: torch.device) -> dict[str, Any]:
    """Split each step's allocator peak where the engine finishes the micro-batches' gradients
    (a diagnostic: the benchmark wraps that one method of this trainer's engine)."""
    phases: dict[str, Any] = {"on": False, "micro_batches": 0, "optimizer": 0}
    finish = trainer.engine.finish

    def finish_and_mark() -> None:
        finish()
        if phases["on"]:
            synchronize(device)
            peak = peak_allocated_bytes(device) or 0
            phases["micro_batches"] = max(phases["micro_batches"], peak)
            reset_peak(device)

    trainer.engine.finish = finish_and_mark
    return phases


def throughput(cfg: Config, step_s: float, device: torch.device) -> dict[str, Any]:
    tokens = cfg.train.global_batch * cfg.train.seq_len
    tps = tokens / step_s
    peak = peak_flops(device)
    mfu = tps * matmul_flops_per_token(cfg.model, cfg.train.seq_len) / peak if peak else None
    return {"tokens_per_s": round(tps), "mfu": mfu, "step_ms": round(step_s * 1e3, 1)}


def memory_vs_estimate(cfg: Config, measured: int | None) -> dict[str, Any]:
    est = estimate(cfg).ranks[0].total()
    ratio = (measured / est) if measured and est else None
    return {
        "estimate_bytes": est,
        "allocator_peak_bytes": measured,
        "measured_over_estimate": ratio,
    }


def finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")
