"""How `bench_pp.py` measures a pipeline step and turns the records into its results.

Measured bubble (both sides, the definition of `plait.schedule.simulate.measure`
applied to compute actions only): 1 − Σ_ranks compute time / (p × makespan), the makespan
running from the first compute start to the last compute end over all ranks. The simulator
is then run on the schedule with the nominal costs (fixed-cost mode), with plait's measured
F/B/W, and with those plus the measured p2p latency.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from common import (
    gather_objects,
    loss_diffs,
    max_over_ranks,
    median,
    pair_ratios,
    ratio_of_medians,
    summarize,
)
from plait.schedule.actions import Action, Kind, TimedAction
from plait.schedule.schedules import build_schedule
from plait.schedule.simulate import Costs, measure, simulate
from pp_config import chunks_for
from pp_sides import Side, compute_only


def pipeline_step(side: Side) -> tuple[float, Mapping[str, Any]]:
    """One step of a side, timed on every rank. Outside the timed region: the max over ranks
    of the step and its pipeline part, and each rank's compute extent and busy time for the
    measured bubble (one all-reduce each; also a barrier)."""
    start = time.perf_counter()
    pipe = side.step()
    elapsed = time.perf_counter() - start
    mine = side.timings()
    compute = compute_only(mine)
    if not side.compute_order:
        side.compute_order = [f"{t.action.kind.value}{t.action.microbatch}.{t.action.chunk}"
                              for t in compute]  # fmt: skip
    t = torch.tensor([elapsed, pipe], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ext = torch.tensor(
        [-min(c.start for c in compute), max(c.end for c in compute)], dtype=torch.float64
    )
    busy = torch.tensor([sum(c.duration for c in compute)], dtype=torch.float64)
    dist.all_reduce(ext, op=dist.ReduceOp.MAX)
    dist.all_reduce(busy)
    return float(t[0]), {"pipe": float(t[1]), "extent": ext, "busy": busy, "timings": mine}


def p2p_latency(shape: tuple[int, ...], rounds: int = 30) -> float:
    """One-way time of one activation-sized message between ranks 0 and 1 (half the median
    ping-pong), seconds; the other ranks idle."""
    t = torch.zeros(shape)
    rank, times = dist.get_rank(), []
    dist.barrier()
    for _ in range(rounds):
        start = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        times.append(time.perf_counter() - start)
    return max_over_ranks(median(times) / 2 if rank == 0 else 0.0)


# ---------------------------------------------------------------- results
def mean_action_ms(rank_stats: list[dict]) -> dict[str, dict[str, float]]:
    """Mean action durations per rank (all chunks) from every rank's totals over the
    recorded steps, and plait's time inside p2p batches per step."""
    means = {}
    for r, st in enumerate(rank_stats):
        by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for key, total in st["sums"].items():
            if key != "comm":
                by_kind[key.split(".")[0]][0] += total
                by_kind[key.split(".")[0]][1] += st["counts"][key]
        means[f"rank{r}"] = {k: v[0] / v[1] * 1e3 for k, v in sorted(by_kind.items()) if v[1]}
        comm = st["sums"].get("comm", 0.0) / max(1, st["steps"])
        means[f"rank{r}"]["comm_ms_per_step"] = comm * 1e3
    return means


def side_result(side: Side) -> tuple[dict, list[dict]]:
    """Summary of one side with every rank's figures (collective: all ranks call it), and
    the per-rank action totals it was made from."""
    stats = gather_objects(
        {"sums": dict(side.kind_sums), "counts": dict(side.kind_counts), "steps": len(side.times)}
    )
    out = {
        **summarize(side.times),
        "pipeline_median_ms": median(side.pipe_times) * 1e3,
        "times_ms": side.times_ms(),
        "bubble_median": median(side.bubbles),
        "bubbles": side.bubbles,
        "mean_action_ms": mean_action_ms(stats),
    }
    out["last_step_timings"] = [
        [t.rank, t.index, str(t.action), t.action.kind.value, t.start, t.end]
        for rows in gather_objects(side.last_timings)
        for t in rows
    ]
    out["compute_order"] = gather_objects(side.compute_order)
    return out, stats


def stage_costs(rank_stats: list[dict], p: int, v: int, split: bool) -> Costs:
    """Mean measured F, B, W of every global stage (chunk·p + rank) over the recorded steps,
    as simulator costs. Where the backward is not split, B ran the whole backward: it is split
    evenly (as PipelineDriver.report does), which leaves b + w, the simulated B, unchanged."""
    costs = {k: [0.0] * (p * v) for k in "FBW"}
    for r, st in enumerate(rank_stats):
        for key, total in st["sums"].items():
            if key != "comm":
                kind, chunk = key.split(".")
                costs[kind][int(chunk) * p + r] = total / st["counts"][key]
    f, b, w = costs["F"], costs["B"], costs["W"]
    if not split:
        b, w = [x / 2 for x in b], [x / 2 for x in b]
    return Costs(f=f, b=b, w=w)


def records_from_rows(rows) -> list[TimedAction]:
    """TimedAction records back from the JSON rows (micro-batch and chunk for compute)."""
    out = []
    for rank, index, text, kind, start, end in rows:
        if kind in ("F", "B", "W"):
            mb, chunk = text[len(kind) :].split(".")[:2]
            action = Action(Kind(kind), int(mb), int(chunk))
        else:
            action = Action(Kind(kind))
        out.append(TimedAction(rank, index, action, start, end))
    return out


def comparison(plait_side: Side, torch_side: Side, entry: dict) -> dict:
    """Equal-work checks (losses, compute order) and the plait/torch time ratios."""
    diffs = loss_diffs(plait_side, torch_side)
    return {
        "loss_first_step": {"plait": plait_side.losses[0], "torch": torch_side.losses[0]},
        "loss_diff_first_step": diffs[0],
        "loss_diff_max": max(diffs),
        "same_compute_order": entry["plait"]["compute_order"] == entry["torch"]["compute_order"],
        **pair_ratios(plait_side, torch_side),
        "pipeline_ratio_of_medians": ratio_of_medians(plait_side.pipe_times, torch_side.pipe_times),
    }


def simulation(
    name: str, opts: argparse.Namespace, world: int, plait_stats: list[dict], latency: float
) -> dict:
    """The simulator's bubble for this schedule with plait's measured F/B/W (and with the p2p
    latency added); in fixed-cost mode also with the nominal costs."""
    v = chunks_for(name, opts)
    sched = build_schedule(name, world, opts.microbatches, v)
    costs = stage_costs(plait_stats, world, v, sched.split_backward)
    with_latency = Costs(costs.f, costs.b, costs.w, latency)
    out = {
        "v": v,
        "simulated_bubble_measured_costs": float(simulate(sched, costs).bubble_fraction),
        "plait_stage_costs_ms": {k: [x * 1e3 for x in getattr(costs, k)] for k in ("f", "b", "w")},
        "simulated_bubble_measured_costs_latency": float(
            simulate(sched, with_latency).bubble_fraction
        ),
    }
    if opts.fixed_cost > 0:
        c = opts.fixed_cost / 1e3 / v
        sim = simulate(sched, Costs(f=c, b=c, w=c))
        out["simulated_bubble"] = float(sim.bubble_fraction)
        out["ideal_makespan_ms"] = float(sim.makespan) * 1e3
    return out


def schedule_result(
    plait_side: Side, torch_side: Side, opts: argparse.Namespace, world: int, latency: float
) -> dict:
    """Everything the JSON keeps of one schedule (collective: all ranks call it)."""
    entry: dict[str, Any] = {}
    entry["plait"], plait_stats = side_result(plait_side)
    entry["torch"], _ = side_result(torch_side)
    entry.update(comparison(plait_side, torch_side, entry))
    entry.update(simulation(plait_side.schedule, opts, world, plait_stats, latency))
    # plait's own measure() over all its records of the last step (communication too)
    plait_all = records_from_rows(entry["plait"]["last_step_timings"])
    entry["plait_measure_last_step"] = float(measure(plait_all, world)[2])
    return entry
