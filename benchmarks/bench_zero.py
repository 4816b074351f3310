"""plait ZeroEngine vs PyTorch's ZeRO implementations: same model, world, batches and AdamW.

Pairs (one per `--stages` entry), each run inside the same process group:
  stage 3: plait ZeRO-3 vs FSDP2 `fully_shard(reshard_after_forward=True)`
  stage 2: plait ZeRO-2 vs FSDP2 `fully_shard(reshard_after_forward=False)`
  stage 1: plait ZeRO-1 vs `ZeroRedundancyOptimizer(AdamW)` over DDP
  stage 0: plait ZeRO-0 (plain data parallelism on the engine) vs DDP + AdamW
FSDP2 shards every transformer block, then the root. Both sides of a pair start from the
same weights (`build_model`, same seed) and train on the same sequence of batches, so the
first step's losses must agree exactly; the largest difference is reported.

After warm-up, the two sides alternate in blocks of `--block` steps, the order flipping
every round, so slow drift of the machine hits both alike. A step is timed on every rank;
its figure is the max over ranks (an all-reduce MAX outside the timed region, which also
lines the ranks up). Then two untimed steps per side measure the logical bytes of every
collective (`zero_sides.CollectiveCounter`) and the memory (torch's MemTracker on both sides;
plait's own MemoryTracker as well). BENCHMARKS.md's ZeRO section has the figures.

    .venv/bin/python benchmarks/bench_zero.py --steps 30 --out benchmarks/results/zero_x.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    alternate,
    cycled_step,
    gather_objects,
    loss_diffs,
    machine,
    max_over_ranks,
    pair_ratios,
    spawn,
    summarize,
    synthetic_batches,
    threads_for,
)
from output import comparison_cells, describe_machine_md, markdown_table, phase_table, publish
from plait.build.model import build_model
from plait.comm import Comm
from plait.config import OptimConfig
from plait.estimate.formulas import zero_comm_elements, zero_model_state_bytes
from plait.mesh import build_mesh
from plait.models.architecture import ModelConfig
from plait.models.presets import get_preset
from plait.topology import Layout
from zero_sides import (
    PHASES,
    DdpSide,
    FsdpSide,
    PlaitSide,
    Side,
    collective_times,
    measure_comm,
    measure_memory,
)

TORCH_NAMES = {3: "FSDP2 (reshard)", 2: "FSDP2 (no reshard)", 1: "DDP+ZeroRedundancyOpt", 0: "DDP"}
PARAM_KEYS = ("Parameter", "Sharded Param", "Unsharded Param")
GRAD_KEYS = ("Gradient", "Sharded Grad", "Unsharded Grad")
OPT_KEYS = ("Optstate", "OptState")


def sized_preset(opts: argparse.Namespace) -> ModelConfig:
    """The preset, with any size flags given on the command line applied."""
    cfg = get_preset(opts.preset)
    sizes = {k: getattr(opts, k) for k in ("n_layers", "d_model", "n_heads")}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in sizes.items() if v is not None})
    return dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, opts.seq_len))


def make_batches(opts: argparse.Namespace, rank: int, vocab: int) -> list[tuple]:
    """`opts.pool` synthetic (x, y) batches for this rank; step i uses batch i mod pool, so
    both sides of a pair see the same sequence."""
    return synthetic_batches(
        1000 * opts.seed + rank, opts.pool, opts.micro_batch, opts.seq_len, vocab
    )


def make_pair(stage: int, env: dict[str, Any]) -> tuple[PlaitSide, Side]:
    """Both sides of a pair, each from a fresh model with the same seed (same weights)."""
    opts, cfg, train_cfg = env["opts"], env["cfg"], env["train_cfg"]
    device = torch.device("cpu")
    plait_side = PlaitSide(stage, build_model(cfg, device, opts.seed), env["comm"], opts, train_cfg)
    model = build_model(cfg, device, opts.seed)
    if stage >= 2:
        torch_side: Side = FsdpSide(model, env["device_mesh"], stage == 3, opts, train_cfg)
    else:
        torch_side = DdpSide(model, stage == 1, opts, train_cfg)
    return plait_side, torch_side


def time_pair(a: Side, b: Side, batches: list, opts: argparse.Namespace) -> None:
    """Warm-up (one step of each side at a time, unrecorded), then rounds of one block of
    `--block` steps each, order flipped, until `--steps` steps per side are recorded."""
    rounds = -(-opts.steps // opts.block)
    step = cycled_step(batches)
    alternate(
        [(a, b)], step, warmup=opts.warmup, rounds=rounds, steps=opts.block, interleave_warmup=True
    )


def loss_check(a: Side, b: Side) -> dict[str, float]:
    """First-step and largest per-step |loss difference|, max over ranks (equal work check)."""
    diffs = loss_diffs(a, b)
    return {"first_step": max_over_ranks(diffs[0]), "max_all_steps": max_over_ranks(max(diffs))}


def side_result(side: Side, comm: dict, mem: list[dict]) -> dict[str, Any]:
    """One side's figures for the JSON: every step time kept, so others can re-derive."""
    return {
        "name": side.name,
        **summarize(side.times),
        "times_ms": side.times_ms(),
        "phases_median_ms_rank0": side.phase_medians_ms(),
        "comm": comm,
        "memory_per_rank": mem,
        "first_loss": side.losses[0],
    }


def run_pair(stage: int, env: dict[str, Any]) -> dict[str, Any]:
    """Time, count bytes and measure memory of one pair; all ranks take part."""
    opts, batches = env["opts"], env["batches"]
    plait_side, torch_side = make_pair(stage, env)
    time_pair(plait_side, torch_side, batches, opts)
    x, y = batches[len(plait_side.losses) % len(batches)]
    comms = [measure_comm(s, x, y) for s in (plait_side, torch_side)]
    x, y = batches[len(plait_side.losses) % len(batches)]
    mems = [measure_memory(s, x, y) for s in (plait_side, torch_side)]
    gathered = gather_objects(mems)  # per rank: ZeroRedundancyOptimizer may be uneven
    psi = sum(p.numel() for p in plait_side.model.parameters())
    out = {
        "stage": stage,
        "psi": psi,
        "theory": theory(stage, psi, dist.get_world_size()),
        "plait": side_result(plait_side, comms[0], [g[0] for g in gathered]),
        "torch": side_result(torch_side, comms[1], [g[1] for g in gathered]),
        **pair_ratios(plait_side, torch_side),
        "loss_diff": loss_check(plait_side, torch_side),
    }
    plait_side.engine.close()
    return out


def theory(stage: int, psi: int, n: int) -> dict[str, Any]:
    """ZeRO paper figures in fp32 (4-byte params and grads, 8 bytes of Adam moments; the
    master weight is the fp32 parameter itself)."""
    elems = zero_comm_elements(stage, psi)
    return {
        "comm_bytes": {k: 4 * v for k, v in elems.items()},
        "comm_bytes_total": 4 * sum(elems.values()),
        "model_state_bytes": zero_model_state_bytes(stage, psi, n, 4, 4, 8),
    }


def worker(rank: int, world: int, opts: argparse.Namespace) -> dict[str, Any]:
    """One rank: gloo timings alone, then every requested pair in turn (fresh models each)."""
    cfg = sized_preset(opts)
    mesh = build_mesh(Layout(dp=world), torch.device("cpu"))
    env = {
        "opts": opts,
        "cfg": cfg,
        "train_cfg": OptimConfig(lr=opts.lr),
        "comm": Comm(mesh),
        "device_mesh": init_device_mesh("cpu", (world,)),
        "batches": make_batches(opts, rank, cfg.vocab_size),
    }
    psi = sum(p.numel() for p in build_model(cfg, torch.device("cpu"), opts.seed).parameters())
    gloo_ms = collective_times(psi)
    pairs = {str(s): run_pair(s, env) for s in opts.stages}
    return {
        "machine": machine(),
        "gloo_collective_ms": gloo_ms,
        "config": {
            **vars(opts),
            "threads_per_rank": threads_for(world),
            "model": dataclasses.asdict(cfg),
        },
        "pairs": pairs,
    }


# ---------------------------------------------------------------- report
def _sum(d: dict[str, int], keys: tuple[str, ...]) -> int:
    """Bytes of the given MemTracker categories (plain and FSDP names differ)."""
    return sum(d.get(k, 0) for k in keys)


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _labelled_sides(res: dict) -> list[tuple[dict, str, str]]:
    """(pair results, "plait" or "torch", row label) for both sides of every pair."""
    return [
        (p, key, label)
        for s, p in res["pairs"].items()
        for key, label in (("plait", f"plait ZeRO-{s}"), ("torch", TORCH_NAMES[int(s)]))
    ]


def time_rows(res: dict) -> list[list]:
    """One row per pair: medians, ratios, minima and the equal-work loss check."""
    rows = []
    for s, p in res["pairs"].items():
        a, b = p["plait"], p["torch"]
        rows.append(
            [
                f"ZeRO-{s} vs {TORCH_NAMES[int(s)]}",
                *comparison_cells(p, a, b),
                a["steps"],
                f"{p['loss_diff']['first_step']:.1e}",
                f"{p['loss_diff']['max_all_steps']:.1e}",
            ]
        )
    return rows


def comm_rows(res: dict) -> list[list]:
    """One row per side: counted bytes by op next to plait's CommStats and the theory."""
    rows = []
    for p, key, label in _labelled_sides(res):
        c = p[key]["comm"]["counted"]
        own = p[key]["comm"].get("plait_comm_stats")
        ops = [
            c.get(op, {}).get("bytes", 0)
            for op in ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
        ]
        rows.append(
            [
                label,
                *ops,
                sum(ops),
                sum(v["calls"] for v in c.values()),
                sum(v["bytes"] for v in own.values()) if own else "-",
                p["theory"]["comm_bytes_total"],
            ]
        )
    return rows


def memory_rows(res: dict) -> list[list]:
    """Max over ranks of each figure (ZeroRedundancyOptimizer's partition is uneven)."""
    rows = []
    for p, key, label in _labelled_sides(res):
        mems = p[key]["memory_per_rank"]
        after = [m["after_step"] for m in mems]
        states = max(_sum(a, PARAM_KEYS + GRAD_KEYS + OPT_KEYS) for a in after)
        other = max(a.get("Total", 0) - _sum(a, PARAM_KEYS + GRAD_KEYS + OPT_KEYS) for a in after)
        own = [m["plait_tracker"] for m in mems if "plait_tracker" in m]
        rows.append(
            [
                label,
                _mib(max(_sum(a, PARAM_KEYS) for a in after)),
                _mib(max(_sum(a, GRAD_KEYS) for a in after)),
                _mib(max(_sum(a, OPT_KEYS) for a in after)),
                _mib(states),
                _mib(p["theory"]["model_state_bytes"]),
                _mib(max(o["model_states"]["device"] for o in own)) if own else "-",
                _mib(other),
                _mib(max(m["peak"].get("Total", 0) for m in mems)),
                _mib(max(o["peak_total"]["device"] for o in own)) if own else "-",
            ]
        )
    return rows


TIME_HEAD = (
    "pair,plait ms,torch ms,plait/torch,per-block,min ms plait / torch,steps,Δloss step 1,max Δloss"
)
COMM_HEAD = (
    "side,all-gather,reduce-scatter,all-reduce,broadcast,total,calls,plait CommStats,ZeRO theory"
)
MEM_HEAD = (
    "side,params,grads,Adam,model states,ZeRO formula,plait tracker states,other live,"
    "peak (MemTracker),peak (plait tracker)"
)


def report(res: dict) -> str:
    """The markdown printed at the end of a run (the JSON holds everything else)."""
    c, m = res["config"], res["config"]["model"]
    psi = next(iter(res["pairs"].values()))["psi"]
    sides = [(p[k]["name"], p[k]) for p in res["pairs"].values() for k in ("plait", "torch")]
    gloo = ", ".join(f"{k} {v:.2f}" for k, v in res.get("gloo_collective_ms", {}).items())
    return "\n\n".join(
        [
            f"### ZeRO: plait vs FSDP2 / ZeroRedundancyOptimizer: {c['preset']} ({psi:,} "
            f"params, {m['n_layers']} layers, d {m['d_model']}), world {c['world']}, "
            f"micro-batch {c['micro_batch']} x seq {c['seq_len']} per rank, fp32, clip {c['clip']}",
            f"Machine: {describe_machine_md(res['machine'])}; {c['threads_per_rank']} thread(s)"
            f"/rank. torch options: AdamW foreach={c['foreach']}, FSDP2 explicit prefetch="
            f"{c['fsdp_prefetch']}, ZeroRedundancyOptimizer bucket view={c['zero_bucket_view']}"
            f", DDP grad view={c['ddp_grad_view']}; bucket {c['bucket_mb']} MiB",
            "Step time (max over ranks), median ms:",
            markdown_table(TIME_HEAD.split(","), time_rows(res)),
            "Logical bytes per step on each rank (CollectiveCounter; plait's CommStats beside):",
            markdown_table(COMM_HEAD.split(","), comm_rows(res)),
            "Memory per rank, MiB, max over ranks (MemTracker after the update unless noted):",
            markdown_table(MEM_HEAD.split(","), memory_rows(res)),
            f"gloo alone on one Ψ-sized fp32 buffer, median ms (max over ranks): {gloo}",
            "Median per-phase time on rank 0 (ms):",
            phase_table("side", PHASES, sides, key="phases_median_ms_rank0"),
        ]
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small-gpt", help="plait model preset")
    ap.add_argument("--n-layers", type=int, default=None, help="override the preset's layers")
    ap.add_argument("--d-model", type=int, default=None, help="override the hidden size")
    ap.add_argument("--n-heads", type=int, default=None, help="override the heads")
    ap.add_argument("--world", type=int, default=2, help="data-parallel ranks (gloo, CPU)")
    ap.add_argument("--stages", default="3,2,1,0", help="comma-separated ZeRO stages to pair")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="plait bucket_mb = DDP cap")
    ap.add_argument("--ddp-grad-view", action="store_true", help="DDP gradient_as_bucket_view")
    ap.add_argument("--foreach", action="store_true", help="torch AdamW foreach=True")
    ap.add_argument("--fsdp-prefetch", action="store_true", help="FSDP2 explicit prefetch")
    ap.add_argument("--zero-bucket-view", action="store_true", help="ZeroRedundancyOptimizer "
                    "parameters_as_bucket_view=True")  # fmt: skip
    ap.add_argument("--clip", type=float, default=1.0, help="grad-norm clip, both; 0 = off")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--pool", type=int, default=8, help="distinct batches cycled through")
    ap.add_argument("--warmup", type=int, default=3, help="unrecorded steps per side")
    ap.add_argument("--steps", type=int, default=30, help="recorded steps per side")
    ap.add_argument("--block", type=int, default=1, help="steps per alternating block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="save JSON here")
    opts = ap.parse_args(argv)
    opts.stages = [int(s) for s in opts.stages.split(",") if s.strip()]
    if any(s not in (0, 1, 2, 3) for s in opts.stages) or opts.warmup < 1:
        ap.error(f"--stages must be among 0,1,2,3 and --warmup >= 1; got {opts.stages}")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    res = spawn(worker, opts.world, opts)
    publish(res, report(res), opts.out)


if __name__ == "__main__":
    main()
