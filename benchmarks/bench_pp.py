"""plait pipeline parallelism vs torch.distributed.pipelining: same stages, micro-batches, world.

Two modes, one process group of `--world` gloo ranks (one pipeline rank each, dp = tp = 1):

**Real model** (default). For every schedule, each rank builds

- plait: `plait.train.Trainer(cfg, mesh, corpus)` with `parallel.pp = world`,
  `parallel.schedule` and `parallel.virtual_stages`; one step is `Trainer.train_step()`
  (sampler, pipeline runtime, tied-embedding gradient sum, global-norm clip, AdamW, loss).
- torch: the *same* pruned model (`build_model` + `prune_to_stages` with the same
  `rank_plans`, so the same layers per stage and the same initial weights), each of this
  rank's stages wrapped in a small `TorchStage` module (embedding / kept blocks / final norm and
  head) and a `torch.distributed.pipelining.PipelineStage`, driven by `ScheduleGPipe`,
  `Schedule1F1B`, `ScheduleInterleaved1F1B` (2 stages per rank) or
  `ScheduleInterleavedZeroBubble` (1 stage per rank, which is ZB-H1; the executed compute order
  is checked equal to plait's `zb-h1`). The loss function is the model's own `LMLoss` divided by
  m with `scale_grads=False`, which is plait's token-weighted rule on text windows (every token
  a target, every micro-batch the same size). The rest of the step does
  what the Trainer does: same sampler and batches, same lr schedule, tied-embedding gradient
  all-reduce between the pipeline ends, global-norm clip (squared norms summed over stages,
  tied matrix counted once), AdamW from `plait.optim.build_optimizer`, loss all-reduce.

**Fixed-cost stages** (`--fixed-cost MS`). The model is a stand-in whose blocks take a fixed
wall time: forward MS/(v·L) per block, input-gradient backward the same, weight-gradient
backward the same (so backward = 2 × forward, split 1:1 between B and W, the simulator's
`Costs(f, b, w)` with f = b = w). The time is burnt by custom autograd Functions (sleep, then a
short spin to the deadline; `--cost-mode spin` spins throughout), so the pipeline's compute
cost is controlled and the measured bubble can be set next to the simulator's prediction.
plait runs `PipelineRuntime` directly (no Trainer: the stand-in is not a Transformer config),
torch runs the same stand-in stages through its schedules.

Timing: every rank times each step with perf_counter; the step figure is the max over ranks
(all-reduce MAX outside the timed region, which also lines the ranks up). After warm-up,
rounds alternate a block of `--steps` plait steps with a block of torch steps per schedule,
the order flipping every round, and the schedules taking turns inside a round.

Measured bubble (both sides, same definition as `plait.schedule.simulate.measure`
applied to compute actions only): 1 − Σ_ranks compute time / (p × makespan), the makespan
running from the first compute start to the last compute end over all ranks. plait's compute
times are its runtime's own `timings`; torch's come from thin wrappers around the stage's
`forward_one_chunk` / `backward_one_chunk` / `backward_weight_one_chunk` (two clock reads per
call).

    .venv/bin/python benchmarks/bench_pp.py --json benchmarks/results/pp_real.json
    .venv/bin/python benchmarks/bench_pp.py --fixed-cost 10 --json benchmarks/results/pp_fixed.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plait
from common import alternate, machine, spawn, threads_for
from output import command_line, comparison_cells, machine_line, markdown_table, publish
from plait.build.corpus import corpus_from_tokens
from plait.data import load_tokens
from plait.schedule.actions import TimedAction
from pp_config import SCHEDULES, fixed_micro, make_config
from pp_measure import p2p_latency, pipeline_step, records_from_rows, schedule_result
from pp_sides import (
    PlaitFixedSide,
    PlaitTrainerSide,
    Side,
    TorchFixedSide,
    TorchRealSide,
    compute_only,
)


# ---------------------------------------------------------------- worker
def build_pairs(opts: argparse.Namespace, world: int, rank: int) -> list[tuple[Side, Side]]:
    """(plait, torch) per schedule, for the fixed-cost stand-in or the real model."""
    pp_group = dist.new_group(list(range(world)))
    ends_group = dist.new_group([0, world - 1])
    if opts.fixed_cost > 0:
        micro = fixed_micro(opts)
        return [
            (
                PlaitFixedSide(name, opts, world, rank, micro),
                TorchFixedSide(name, opts, world, rank, micro, pp_group),
            )
            for name in opts.schedules
        ]
    cfg0 = make_config(opts.schedules[0], opts, world)
    corpus = corpus_from_tokens(load_tokens(None, cfg0.data.max_bytes), cfg0)
    return [
        (
            PlaitTrainerSide(name, opts, corpus, world),
            TorchRealSide(name, opts, corpus, world, rank, (pp_group, ends_group)),
        )
        for name in opts.schedules
    ]


def worker(rank: int, world: int, opts: argparse.Namespace) -> dict:
    """One rank: every schedule's pair, timed in alternating blocks, then each schedule's
    results (the schedules take turns inside a round)."""
    fixed = opts.fixed_cost > 0
    pairs = build_pairs(opts, world, rank)
    width = opts.d_model if fixed else pairs[0][0].cfg.model.d_model
    latency = p2p_latency((opts.micro_batch, opts.seq_len, width))
    alternate(pairs, pipeline_step, warmup=opts.warmup, rounds=opts.rounds, steps=opts.steps)
    results = {a.schedule: schedule_result(a, b, opts, world, latency) for a, b in pairs}
    return {
        "machine": machine(),
        "mode": "fixed-cost" if fixed else "real",
        "config": {**vars(opts), "world": world, "threads_per_rank": threads_for(world)},
        "p2p_one_way_ms": latency * 1e3,
        "schedules": results,
    }


# ---------------------------------------------------------------- report and charts
TIME_HEAD = [
    "schedule",
    "plait median ms",
    "torch median ms",
    "plait/torch",
    "per-round",
    "min ms plait / torch",
    "pipeline part ms plait / torch",
    "|Δloss| step 1",
    "same compute order",
]
BUBBLE_HEAD = [
    "schedule",
    "simulated bubble (nominal costs)",
    "simulated (plait's measured F/B/W)",
    "same + p2p latency",
    "plait measured",
    "plait − nominal (points)",
    "torch measured",
    "ideal makespan ms",
]
COST_HEAD = ["schedule", "side", "rank", "F", "B", "W", "p2p ms/step"]


def _head(res: dict) -> str:
    """The title line: the mode and the pipeline's shape."""
    c = res["config"]
    if res["mode"] == "fixed-cost":
        return (
            f"### Fixed-cost stages: forward {c['fixed_cost']} ms per stage (÷ v per chunk), "
            f"backward 2× (B = W), {c['cost_mode']}; p={c['world']}, m={c['microbatches']}, "
            f"{c['layers_per_stage']} block(s) per stage, activations "
            f"{c['micro_batch']}×{c['seq_len']}×{c['d_model']} fp32"
        )
    return (
        f"### {c['model']} ({c['n_layers']} layers), p={c['world']}, m={c['microbatches']} "
        f"micro-batches of {c['micro_batch']}×{c['seq_len']} tokens, AdamW, clip {c['clip']}"
    )


def _time_row(name: str, e: dict) -> list:
    p, t = e["plait"], e["torch"]
    return [
        name + (f" (v={e['v']})" if e["v"] > 1 else ""),
        *comparison_cells(e, p, t),
        f"{p['pipeline_median_ms']:.1f} / {t['pipeline_median_ms']:.1f}",
        f"{e['loss_diff_first_step']:.1e}",
        "yes" if e["same_compute_order"] else "NO",
    ]


def _bubble_row(name: str, e: dict, fixed: bool) -> list:
    p, t = e["plait"], e["torch"]
    sim = e.get("simulated_bubble")
    return [
        name,
        f"{sim:.1%}" if sim is not None else "-",
        f"{e['simulated_bubble_measured_costs']:.1%}",
        f"{e['simulated_bubble_measured_costs_latency']:.1%}",
        f"{p['bubble_median']:.1%}",
        f"{(p['bubble_median'] - sim) * 100:+.1f}" if sim is not None else "-",
        f"{t['bubble_median']:.1%}",
        f"{e['ideal_makespan_ms']:.1f}" if fixed else "-",
    ]


def _cost_rows(name: str, e: dict) -> list[list]:
    rows = []
    for side in ("plait", "torch"):
        for r, means in e[side]["mean_action_ms"].items():
            rows.append(
                [
                    name,
                    side,
                    r,
                    *(f"{means[k]:.2f}" if k in means else "-" for k in ("F", "B", "W")),
                    f"{means['comm_ms_per_step']:.2f}" if side == "plait" else "-",
                ]
            )
    return rows


def report(res: dict) -> str:
    """The markdown printed at the end of a run (the JSON holds everything else)."""
    c, fixed = res["config"], res["mode"] == "fixed-cost"
    schedules = res["schedules"].items()
    lines = [
        _head(res),
        "",
        machine_line(res, c["threads_per_rank"])
        + f"; p2p one-way {res['p2p_one_way_ms']:.2f} ms per activation message",
        "",
        markdown_table(TIME_HEAD, [_time_row(name, e) for name, e in schedules]),
        "",
        markdown_table(BUBBLE_HEAD, [_bubble_row(name, e, fixed) for name, e in schedules]),
        "",
        "Mean duration of one action (ms) and plait's time inside p2p batches per step:",
        "",
        markdown_table(COST_HEAD, [row for name, e in schedules for row in _cost_rows(name, e)]),
    ]
    return "\n".join(lines)


def charts(res: dict, prefix: str) -> list[str]:
    """Measured Gantt chart of plait's last step per schedule, and a bubble bar chart."""
    return [*_gantt_charts(res, prefix), _bubble_chart(res, prefix)]


def _gantt_charts(res: dict, prefix: str) -> list[str]:
    """plait's compute records of its last step, per schedule, in ms."""
    from plait.schedule.chart import gantt_chart

    paths = []
    for name, e in res["schedules"].items():
        recs = [
            TimedAction(t.rank, t.index, t.action, t.start * 1e3, t.end * 1e3)
            for t in compute_only(records_from_rows(e["plait"]["last_step_timings"]))
        ]
        sim = e.get("simulated_bubble")
        title = f"plait {name}, measured bubble {e['plait']['bubble_median']:.1%}"
        if sim is not None:
            title += f", simulated {sim:.1%}"
        path = f"{prefix}_{name}.png"
        gantt_chart(recs, Path(path), title=title, time_unit="ms")
        paths.append(path)
    return paths


def _bubble_chart(res: dict, prefix: str) -> str:
    """Measured bubbles of both sides (and the simulated one, fixed-cost) per schedule."""
    from matplotlib.figure import Figure

    names = list(res["schedules"])
    fig = Figure(figsize=(6.4, 3.0), dpi=100)
    ax = fig.subplots()
    xs = range(len(names))
    width = 0.27
    series = [("torch measured", [res["schedules"][n]["torch"]["bubble_median"] for n in names])]
    series.insert(
        0, ("plait measured", [res["schedules"][n]["plait"]["bubble_median"] for n in names])
    )
    if res["mode"] == "fixed-cost":
        series.insert(0, ("simulated", [res["schedules"][n]["simulated_bubble"] for n in names]))
    for i, (label, vals) in enumerate(series):
        ax.bar([x + (i - 1) * width for x in xs], [v * 100 for v in vals], width, label=label)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("bubble %")
    ax.legend(fontsize=8)
    ax.set_title(f"pipeline bubble, p={res['config']['world']}, m={res['config']['microbatches']}")
    fig.tight_layout()
    path = f"{prefix}_bubble.png"
    fig.savefig(path)
    return path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, help="pipeline ranks (gloo, CPU)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated")
    ap.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank, interleaved")
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (m)")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--model", default="small-gpt", help="plait preset (real mode)")
    ap.add_argument("--n-layers", type=int, default=4, help="real mode; >= world x v")
    ap.add_argument("--clip", type=float, default=1.0, help="grad-norm clip, real mode; 0 = off")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus bytes (real mode)")
    ap.add_argument(
        "--fixed-cost", type=float, default=0.0, help="MS: fixed-cost stages (forward ms/stage)"
    )
    ap.add_argument("--cost-mode", choices=("sleep", "spin"), default="sleep")
    ap.add_argument("--layers-per-stage", type=int, default=1, help="fixed-cost blocks per stage")
    ap.add_argument("--d-model", type=int, default=128, help="fixed-cost activation width")
    ap.add_argument("--warmup", type=int, default=3, help="unrecorded steps per side")
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=3, help="steps per block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--charts", default=None, help="PNG prefix, e.g. benchmarks/results/pp_fixed")
    ap.add_argument("--json", default=None, help="save results here")
    opts = ap.parse_args(argv)
    opts.schedules = [s for s in opts.schedules.split(",") if s]
    unknown = set(opts.schedules) - set(SCHEDULES)
    if unknown:
        ap.error(f"unknown schedules {sorted(unknown)}; known: {', '.join(SCHEDULES)}")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    start = time.perf_counter()
    res = spawn(worker, opts.world, opts)
    env = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    res["command"] = env + command_line()
    res["plait_module"] = plait.__file__  # which plait was measured (see PYTHONPATH)
    res["wall_s"] = time.perf_counter() - start
    if opts.charts:
        res["charts"] = charts(res, opts.charts)
    publish(res, report(res) + f"\n\nwall {res['wall_s']:.0f} s", opts.json)


if __name__ == "__main__":
    main()
