"""plait tensor parallelism vs PyTorch DTensor tensor parallelism: same model, world, batches.

One process group of `--world` gloo ranks, all in one tensor-parallel group (tp = world). Each
rank builds two copies of the same preset with the same seed:

- plait: `build_model(cfg, device, seed, parallelize=apply_tensor_parallel(..., sp))` on
  `build_mesh(Layout(tp=world))`. Step: forward (vocabulary-parallel loss), backward, the
  split-model rules of `plait.parallel.grads` (`SplitGradRules.sync`: SP partial sums;
  `SplitGradRules.norm` + `clip_coef`: the clip), AdamW, zero_grad.
- DTensor: the plain `build_model(cfg, device, seed)` (no plait TP), parallelized with
  `parallelize_module` on `init_device_mesh("cpu", (world,))` by `dtensor_plan` below, the
  torchtitan-style plan: `ColwiseParallel` for wq/wk/wv and fc1 (w_gate/w_up),
  `RowwiseParallel` for wo and fc2 (w_down), `PrepareModuleInput` on `attn` and `mlp` so that
  q, k and v share one input redistribution (one backward all-reduce per block, as plait's f),
  `RowwiseParallel` for the token embedding, `ColwiseParallel` for the head with
  `Shard(-1)` logits and `loss_parallel()` around forward and backward, and with sequence
  parallelism `SequenceParallel` for the norms and `Shard(1)` between blocks. A tied head is
  re-tied to the embedding's DTensor after parallelization (both are `Shard(0)`). Step:
  forward and backward under `loss_parallel()`, gradient clipping with
  `torch.nn.utils.get_total_norm` / `clip_grads_with_norm_` (DTensor and plain parameters
  are normed separately and combined: `clip_grad_norm_` refuses the mix), AdamW, zero_grad.

Both sides use AdamW from `plait.optim.build_optimizer` and see the same batches (every tp
rank gets the same batch), so their losses must agree step by step; the first step's loss is
reported for both (same initial weights: plait's shards are compared with the DTensor local
shards before the first step).

Timing as in bench_dp.py: after warm-up, rounds alternate a block of `--steps` plait steps with
a block of DTensor steps (order flipped every round); a step's figure is the max over ranks
(all-reduce MAX outside the timed region, which also lines the ranks up).

Bytes per step (logical: all-reduce = the buffer, all-gather = the gathered output,
reduce-scatter = the input, plait's `comm.py` convention) are taken from one untimed step per
side, run before warm-up under `CollectiveBytes`, a `CommDebugMode` (torch.distributed.tensor
.debug) that also records each collective's tensor sizes and the step phase. DTensor lowers its
redistributions to `_c10d_functional` ops and plait calls `c10d` ops, so the same counter sees
both sides; plait's figure is also read from `comm.stats` and the two must agree.

    .venv/bin/python benchmarks/bench_tp.py --json benchmarks/results/tp_nosp.json
    .venv/bin/python benchmarks/bench_tp.py --sequence-parallel --json benchmarks/results/tp_sp.json
    .venv/bin/python benchmarks/bench_tp.py --summarize benchmarks/results/tp_*.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    alternate,
    cycled_step,
    loss_diffs,
    machine,
    max_over_ranks,
    pair_ratios,
    spawn,
    step_figures,
    synthetic_batches,
    threads_for,
)
from output import (
    TIME_COLUMNS,
    comparison_cells,
    machine_line,
    markdown_table,
    phase_table,
    publish,
    ratio_line,
    time_cells,
)
from plait.build.model import build_model
from plait.comm import Comm
from plait.composition import check_tensor_parallel
from plait.config import OptimConfig
from plait.mesh import build_mesh
from plait.models.presets import get_preset
from plait.parallel.tp.apply import apply_tensor_parallel
from plait.topology import Layout
from tp_sides import (
    PHASES,
    DTensorSide,
    PlaitSide,
    Side,
    build_dtensor_model,
    counted_step,
    initial_param_diff,
)


def make_batches(opts, vocab: int) -> list:
    """`opts.pool` batches (x, y); the same on every rank (tp ranks share their batch)."""
    return synthetic_batches(opts.seed + 1, opts.pool, opts.micro_batch, opts.seq_len, vocab)


def build_sides(opts: argparse.Namespace, world: int) -> tuple[PlaitSide, DTensorSide, float]:
    """Both sides from the same preset and seed, and the largest initial difference between
    plait's shards and DTensor's local shards (max over ranks): 0 when both start alike."""
    device, sp = torch.device("cpu"), opts.sequence_parallel
    cfg = get_preset(opts.model)
    check_tensor_parallel(cfg, world, sp, opts.seq_len)
    mesh = build_mesh(Layout(tp=world), device)
    comm = Comm(mesh)
    train_cfg = OptimConfig(lr=opts.lr)
    tp_model = build_model(
        cfg, device, opts.seed, parallelize=lambda m: apply_tensor_parallel(m, mesh, comm, sp)
    )
    dt_model = build_dtensor_model(cfg, opts.seed, sp, world)
    param_diff = max_over_ranks(initial_param_diff(tp_model, dt_model))
    return (
        PlaitSide(tp_model, comm, opts, train_cfg),
        DTensorSide(dt_model, opts, train_cfg),
        param_diff,
    )


def local_params(side: Side) -> int:
    """Parameters this rank holds (its shards: DTensors count their local part)."""
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in side.model.parameters()
    )


def worker(rank: int, world: int, opts: argparse.Namespace) -> dict:
    """One rank: count each side's bytes in one untimed step, then alternate timed blocks."""
    plait_side, dt_side, param_diff = build_sides(opts, world)
    batches = make_batches(opts, get_preset(opts.model).vocab_size)
    load_start = os.getloadavg()
    counted = {s.name: counted_step(s, batches[0]) for s in (plait_side, dt_side)}
    plait_stats_first = plait_side.stats_last
    pair = (plait_side, dt_side)
    step = cycled_step(batches)
    alternate([pair], step, warmup=opts.warmup, rounds=opts.rounds, steps=opts.steps)
    return {
        "machine": machine(),
        "config": {**vars(opts), "threads_per_rank": threads_for(world)},
        "loadavg_1_5_15": {"start": load_start, "end": os.getloadavg()},
        "local_params": {s.name: local_params(s) for s in pair},
        "initial_param_max_abs_diff": param_diff,
        "first_loss": {"plait": plait_side.losses[0], "dtensor": dt_side.losses[0]},
        "final_loss": {"plait": plait_side.losses[-1], "dtensor": dt_side.losses[-1]},
        "max_loss_diff": max_over_ranks(max(loss_diffs(plait_side, dt_side))),
        "comm": {
            **counted,
            "plait_comm_stats_first_step": plait_stats_first,
            "plait_comm_stats_last_step": plait_side.stats_last,
        },
        **{s.name: step_figures(s) for s in pair},
        **pair_ratios(plait_side, dt_side, per_block=True),
    }


# ---------------------------------------------------------------- output
def _ops(c: dict) -> str:
    return ", ".join(f"{k} {v['calls']}× {v['bytes']:,}" for k, v in c["by_op"].items())


def report(res: dict, target: float) -> str:
    """The markdown printed at the end of a run (the JSON holds everything else)."""
    p, d, c, cm = res["plait"], res["dtensor"], res["config"], res["comm"]
    sp = "with" if c["sequence_parallel"] else "without"
    stats_bytes = cm["plait_comm_stats_first_step"]["total"][2]
    load = res["loadavg_1_5_15"]
    rows = [
        [name, *time_cells(s), cm[key]["bytes"], cm[key]["calls"]]
        for name, key, s in (("plait", "plait", p), ("DTensor", "dtensor", d))
    ]
    lines = [
        f"### plait TP vs DTensor TP, {sp} sequence parallelism: {c['model']}, tp {c['world']}, "
        f"batch {c['micro_batch']} x seq {c['seq_len']}, clip {c['clip']:g}, "
        f"DTensor Partial grads {c['dtensor_partial']}",
        "",
        machine_line(res, c["threads_per_rank"])
        + f"; load average (1 min) {load['start'][0]:.1f} at start, {load['end'][0]:.1f} at end",
        "",
        markdown_table(["impl", *TIME_COLUMNS, "bytes/step", "calls"], rows),
        "",
        ratio_line(res, "DTensor", target),
        "",
        f"first-step loss plait {res['first_loss']['plait']:.7f}, DTensor "
        f"{res['first_loss']['dtensor']:.7f}; max |loss diff| over all steps "
        f"{res['max_loss_diff']:.2e}; initial parameters max |diff| "
        f"{res['initial_param_max_abs_diff']:.1e}",
        "",
        f"plait collectives: {_ops(cm['plait'])} (comm.stats: {stats_bytes:,} bytes)",
        f"DTensor collectives: {_ops(cm['dtensor'])}",
        "",
        "Bytes per phase: " + "; ".join(f"{n} {cm[n]['by_phase']}" for n in ("plait", "dtensor")),
        "",
        "Median per-phase time on rank 0 (ms):",
        "",
        phase_table("impl", PHASES, (("plait", p), ("DTensor", d))),
    ]
    return "\n".join(lines)


def summary_table(paths: list[str]) -> str:
    """One row per saved run, for BENCHMARKS.md."""
    rows = []
    for path in paths:
        r = json.loads(Path(path).read_text())
        c, p, d, cm = r["config"], r["plait"], r["dtensor"], r["comm"]
        setup = (
            f"{c['model']} tp{c['world']} b{c['micro_batch']} s{c['seq_len']} "
            f"{'SP' if c['sequence_parallel'] else 'no SP'} clip{c['clip']:g}"
            + (" eager-partial" if c["dtensor_partial"] == "eager" else "")
        )
        rows.append(
            [
                Path(path).stem,
                setup,
                *comparison_cells(r, p, d),
                f"{cm['plait']['bytes']:,} / {cm['dtensor']['bytes']:,}",
                f"{cm['plait']['calls']} / {cm['dtensor']['calls']}",
                f"{r['first_loss']['plait']:.6f} / {r['first_loss']['dtensor']:.6f}",
                f"{r['max_loss_diff']:.1e}",
            ]
        )
    header = [
        "run",
        "setup",
        "plait median ms",
        "DTensor median ms",
        "plait/DTensor",
        "per-round",
        "min ms plait / DTensor",
        "bytes/step plait / DTensor",
        "collectives plait / DTensor",
        "first loss plait / DTensor",
        "max abs Δloss",
    ]
    return markdown_table(header, rows)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small-gpt", help="plait preset name")
    ap.add_argument("--world", type=int, default=2, help="ranks = tp (gloo, CPU)")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--sequence-parallel", action="store_true", help="SP on both sides")
    ap.add_argument(
        "--dtensor-partial",
        choices=("lazy", "eager"),
        default="lazy",
        help="DTensor SP norm gradients are Partial: lazy = leave them (reduced inside every "
        "clip/optimizer op that reads them), eager = redistribute each to Replicate once",
    )
    ap.add_argument("--clip", type=float, default=1.0, help="grad-norm clip (both sides); 0 = off")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--pool", type=int, default=8, help="distinct batches cycled through")
    ap.add_argument("--warmup", type=int, default=5, help="unrecorded steps per side")
    ap.add_argument("--rounds", type=int, default=30, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=5, help="steps per block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=1.0, help="ratio to meet")
    ap.add_argument("--json", default=None, help="save results here")
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="print the table of saved runs")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    if opts.summarize:
        print(summary_table(opts.summarize))
        return
    res = spawn(worker, opts.world, opts)
    publish(res, report(res, opts.target), opts.json)


if __name__ == "__main__":
    main()
