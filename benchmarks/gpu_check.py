"""The GPU check: what plait's CUDA path does on one NVIDIA GPU, in a few minutes.

Everything else in plait is proved on CPU and gloo; this script is the one place that runs the
same code on a GPU and says what it saw. A person with one CUDA GPU runs

    .venv/bin/python benchmarks/gpu_check.py --out runs/gpu-check

(under 8 minutes on an H100/H200) and gets a table and `gpu_check.json`. The checks, each
independent (one that breaks is reported with its traceback and the rest still run):

- `parity`: a tiny LLaMA in fp32 trained on the CPU and on the GPU from the same seed; the
  loss of every step and the parameters at the end agree to rounding (cuBLAS sums in another
  order than the CPU's kernels, so not bitwise).
- `text`: a 1.1B LLaMA (TinyLlama's shape) in bf16 on text rows: step time, tokens/s, MFU
  against the card's dense bf16 peak, whether attention can run on SDPA's flash kernel, and
  the allocator's peak (`max_memory_allocated`) next to `plait estimate`'s total for the
  same config.
- `offload_exact`: the same model with full recompute, with and without
  `--offload-activations cpu` (the side-stream copies of `device.HostCopies`), in torch's
  deterministic mode: the losses must be equal bit for bit (offload moves tensors, it changes
  no arithmetic; two plain runs are compared too, to show the mode is deterministic).
- `offload_memory`: with and without offload, without and with full recompute: the device
  peak must drop; shown next to the estimate and the meter's saved bytes (device, host).
- `packed`: instruction rows (the standard library's docstrings as Alpaca data, a 32k BPE)
  packed under each `--packed-attention` mode (the dense block-causal mask, one causal call
  per document, flash attention's varlen kernel): tokens/s and the peak against the
  estimate, and each mode's loss and gradients against the mask's on one batch.
- `cli`: `plait train --device cuda` as a user runs it, end to end (launch, summary, MFU).

On a machine without CUDA it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plait.build.model import build_model
from plait.config import Config
from plait.device import (
    cuda_available,
    peak_flops,
)
from plait.estimate import estimate
from plait.mesh import build_mesh
from plait.models.presets import get_preset
from plait.train import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_runs import (
    ONE_B,
    SEQ,
    TORCHTITAN,
    finite,
    memory_vs_estimate,
    one_b_config,
    release,
    run_steps,
    throughput,
    tiny_config,
)


def check_parity(device: torch.device, workdir: Path) -> dict[str, Any]:
    steps = 6
    cpu = run_steps(tiny_config("cpu", steps), torch.device("cpu"), params=True)
    gpu = run_steps(tiny_config("cuda", steps), device, params=True)
    rel = [abs(a - b) / abs(a) for a, b in zip(cpu["losses"], gpu["losses"], strict=True)]
    worst = max(
        float((gpu["params"][n] - p).abs().max() / p.abs().max().clamp_min(1e-12))
        for n, p in cpu["params"].items()
    )
    ok = max(rel) < 1e-4 and worst < 1e-3
    return {"ok": ok, "loss_max_rel_diff": max(rel), "param_max_rel_diff": worst,
            "cpu_losses": cpu["losses"], "gpu_losses": gpu["losses"]}  # fmt: skip


def flash_usable(cfg: Config, device: torch.device) -> bool:
    """Whether one forward of the model runs with SDPA restricted to its flash kernel (an
    explicit mask, or a layout flash cannot take, makes SDPA refuse)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = build_mesh(cfg.parallel.layout, device, 300)
    trainer = Trainer(cfg, mesh)
    x = torch.randint(0, 256, (1, cfg.train.seq_len), device=device)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.no_grad():
            trainer.model(x)
        return True
    except RuntimeError:
        return False
    finally:
        trainer.close()
        del trainer
        release(device)


def check_text(device: torch.device, workdir: Path) -> dict[str, Any]:
    cfg = one_b_config(steps=6)
    run = run_steps(cfg, device)
    out = {"ok": all(map(finite, run["losses"])), "losses": run["losses"]}
    out |= throughput(cfg, run["step_s"], device)
    out |= memory_vs_estimate(cfg, run["allocator_peak"])
    out |= {k: run[k] for k in ("peak_micro_batches", "peak_optimizer")}
    out["flash"] = flash_usable(one_b_config(steps=1), device)
    out["torchtitan"] = TORCHTITAN
    return out


def check_offload_exact(device: torch.device, workdir: Path) -> dict[str, Any]:
    """Full recompute with and without activation offload, in torch's deterministic mode
    (flash attention's and cuBLAS's default backward kernels may add in any order, so two
    plain runs can differ in the last bit): twice plain, once offloaded, equal bit for bit."""
    par = {"recompute": "full"}
    torch.use_deterministic_algorithms(True)
    try:
        plain = run_steps(one_b_config(steps=3, memory=par), device)
        again = run_steps(one_b_config(steps=3, memory=par), device)
        off_par = par | {"offload_activations": "cpu"}
        off = run_steps(one_b_config(steps=3, memory=off_par), device)
    finally:
        torch.use_deterministic_algorithms(False)
    deterministic = plain["losses"] == again["losses"]
    equal = plain["losses"] == off["losses"]
    return {"ok": deterministic and equal, "plain_runs_equal": deterministic,
            "offload_equal": equal, "plain": plain["losses"], "again": again["losses"],
            "offload": off["losses"]}  # fmt: skip


def check_offload_memory(
    device: torch.device, workdir: Path, meter: bool = False
) -> dict[str, Any]:
    """The device peak with and without `--offload-activations cpu`, without recompute (every
    saved tensor moves) and with full recompute (the block inputs move), next to the estimate
    and (`meter`, which holds what it counts a little longer: not for the peaks) the meter's
    saved bytes on the device and the host. Offload lowers the peak of the micro-batches (what
    it moves lives there); the optimizer's peak is another matter."""
    out: dict[str, Any] = {}
    for recompute in ("none", "full"):
        for where in ("none", "cpu"):
            par = {"recompute": recompute, "offload_activations": where}
            cfg = one_b_config(steps=4, memory=par)
            run = run_steps(cfg, device, meter=meter)
            out[f"recompute={recompute},offload={where}"] = {
                "allocator_peak": run["allocator_peak"],
                "peak_micro_batches": run["peak_micro_batches"],
                "peak_optimizer": run["peak_optimizer"],
                "estimate": estimate(cfg).ranks[0].total(),
                "saved_device": run["saved_device"],
                "saved_host": run["saved_host"],
                "step_ms": round(run["step_s"] * 1e3, 1),
                "losses": run["losses"],
            }
    peak = {name: row["peak_micro_batches"] for name, row in out.items()}
    drops = [peak[f"recompute={r},offload=cpu"] < peak[f"recompute={r},offload=none"]
             for r in ("none", "full")]  # fmt: skip
    return {"ok": all(drops), **out}


def prepare_instructions(workdir: Path) -> Path:
    """Alpaca rows from this Python's standard library (`plait data instructions`), tokenized
    by a 32,000-token BPE trained on its sources, as the fine-tuning recipe does, in `workdir`."""
    rows, tok, out = workdir / "ins.jsonl", workdir / "tok.json", workdir / "sft"
    plait = [sys.executable, "-m", "plait.cli"]
    steps = [
        ["data", "instructions", "--out", str(rows), "--overwrite"],
        ["tokenizer", "train", "--vocab-size", "32000", "--out", str(tok), "--no-progress"],
        ["data", "prepare", "--format", "alpaca", "--data", str(rows), "--tokenizer", str(tok),
         "--out", str(out), "--seq-len", str(SEQ), "--overwrite", "--no-progress"],
    ]  # fmt: skip
    for argv in steps:
        subprocess.run([*plait, *argv], check=True)
    return out


PACKED_MODES = ("mask", "per-document", "varlen")
DOCUMENTS = (512, 300, 700, 536)  # a 2,048-token row of four documents


def check_packed(device: torch.device, workdir: Path) -> dict[str, Any]:
    """Packed instruction rows under each `--packed-attention` mode: tokens/s and the peak
    against the estimate (the dense mask costs (b, 1, s, s); the others do not), the first
    step's loss (same weights and rows) equal across modes to bf16 rounding; then one batch's
    loss and gradients per mode against the mask (`packed_attention_gaps`)."""
    folder = prepare_instructions(workdir)
    out: dict[str, Any] = {}
    for mode in PACKED_MODES:
        cfg = one_b_config(steps=4, packed_attention=mode, data=str(folder))
        run = run_steps(cfg, device)
        out[mode] = {"losses": run["losses"], **throughput(cfg, run["step_s"], device)}
        out[mode] |= memory_vs_estimate(cfg, run["allocator_peak"])
    first = [out[m]["losses"][0] for m in PACKED_MODES]
    out["first_loss_spread"] = (max(first) - min(first)) / first[0]
    out["gaps"] = packed_gaps(device)
    worst = max(g["loss_gap"] for g in out["gaps"].values())
    out["ok"] = out["first_loss_spread"] < 2e-3 and worst < 2e-3
    return out


def packed_gaps(device: torch.device) -> dict[str, Any]:
    """One row of four documents through a 4-layer model of the 1.1B's width: fp32 mask
    against per-document (exact to rounding), then bf16 mask and per-document against varlen."""
    from plait.models.packed_compare import packed_attention_gaps

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32000, (1, SEQ), generator=gen)
    targets = torch.randint(0, 32000, (1, SEQ), generator=gen)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(DOCUMENTS)])[None]
    batch = [t.to(device) for t in (tokens, targets, segments)]
    out = {}
    shape = get_preset("llama-7b")
    for key, value in (ONE_B | {"n_layers": 4}).items():
        setattr(shape, key, value)
    for dtype, modes in ((torch.float32, PACKED_MODES[:2]), (torch.bfloat16, PACKED_MODES)):
        model = build_model(shape, device, seed=0).to(dtype).train()
        for gap in packed_attention_gaps(model, *batch, modes=modes)[1:]:
            out[f"{dtype}:{gap.mode}-vs-mask"] = {
                "loss": gap.loss, "loss_gap": gap.loss_gap,
                "grad_gap": gap.grad_gap, "worst": gap.worst,
            }  # fmt: skip
        del model
    return out


def check_cli(device: torch.device, workdir: Path) -> dict[str, Any]:
    out = workdir / "cli-run"
    cmd = [sys.executable, "-m", "plait.cli", "train", "--device", "cuda", "--precision", "bf16"]
    cmd += ["--model", "small-llama", "--steps", "20", "--out", str(out), "--overwrite"]
    done = subprocess.run([*cmd, "--no-progress"], capture_output=True, text=True)
    summary = out / "summary.json"
    s = json.loads(summary.read_text()) if summary.exists() else {}
    keep = ("final_loss", "val_loss", "tokens_per_s", "mfu", "peak_flops")
    return {"ok": done.returncode == 0 and bool(s), "rc": done.returncode,
            "stderr_tail": done.stderr[-2000:], **{k: s.get(k) for k in keep}}  # fmt: skip


CHECKS: dict[str, Callable[[torch.device, Path], dict[str, Any]]] = {
    "parity": check_parity,
    "text": check_text,
    "offload_exact": check_offload_exact,
    "offload_memory": check_offload_memory,
    "packed": check_packed,
    "cli": check_cli,
}


def environment(device: torch.device) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(device)  # benchmarks may ask torch.cuda
    return {"torch": torch.__version__, "device": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "peak_flops": peak_flops(device)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/gpu-check", help="folder for gpu_check.json")
    ap.add_argument("--only", default="", help="comma-separated checks: " + ",".join(CHECKS))
    args = ap.parse_args(argv)
    if not cuda_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); "
              "run it on a machine with an NVIDIA GPU")  # fmt: skip
        return 2
    names = [n for n in args.only.split(",") if n] or list(CHECKS)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        print(f"gpu_check: unknown check(s) {', '.join(unknown)}; known: {', '.join(CHECKS)}")
        return 2
    device = torch.device("cuda", 0)
    results: dict[str, Any] = {"environment": environment(device)}
    print(json.dumps(results["environment"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            t0 = time.perf_counter()
            try:
                res = CHECKS[name](device, Path(tmp))
            except Exception:
                res = {"ok": False, "error": traceback.format_exc()[-3000:]}
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            results[name] = res
            print(name, json.dumps(res, default=str), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    failed = [n for n in names if not results[n]["ok"]]
    print("gpu_check:", "all passed" if not failed else f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # cuBLAS's deterministic mode (check_offload_exact) needs this before CUDA starts
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sys.exit(main())
