"""plait tensor parallelism vs PyTorch DTensor tensor parallelism: same model, world, batches.

One process group of `--world` gloo ranks, all in one tensor-parallel group (tp = world). Each
rank builds two copies of the same preset with the same seed:

- plait: `build_model(cfg, device, seed, parallelize=apply_tensor_parallel(..., sp))` on
  `build_mesh(Layout(tp=world))`. Step: forward (vocabulary-parallel loss), backward,
  `sync_sequence_parallel_grads`, `clip_tp_grad_norm_`, AdamW, zero_grad.
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
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    describe_machine_md,
    machine,
    markdown_table,
    max_over_ranks,
    median,
    paired_ratio,
    save_json,
    spawn,
    summarize,
    threads_for,
)
from plait.comm import Comm
from plait.config import TrainConfig
from plait.mesh import build_mesh
from plait.models.config import ModelConfig
from plait.models.presets import get_preset
from plait.optim import build_optimizer
from plait.parallel.tensor_parallel import (
    apply_tensor_parallel,
    check_tensor_parallel,
    clip_tp_grad_norm_,
    sync_sequence_parallel_grads,
)
from plait.topology import Layout
from plait.train import build_model

PHASES = ("forward", "backward", "sync", "clip", "optim", "zero")


# ---------------------------------------------------------------- the DTensor side
def dtensor_plan(cfg: ModelConfig, sp: bool) -> dict:
    """parallelize_module plan for a models.transformer.Transformer (torchtitan's recipe)."""
    between = Shard(1) if sp else Replicate()  # the residual stream between blocks
    plan: dict = {}
    if sp and cfg.pos == "learned":
        # Embedding.forward adds the (s, h) position table to the token lookup, so the lookup
        # must be whole: sum it (all-reduce), add positions, then keep this rank's positions.
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate())
        plan["embed"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1)
        )
    else:  # reduce-scatter straight into sequence shards under SP, all-reduce without
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    plan["head"] = ColwiseParallel(
        input_layouts=between, output_layouts=Shard(-1), use_local_output=False
    )
    if sp:
        plan["norm"] = SequenceParallel()
    mlp = ("w_gate", "w_up", "w_down") if cfg.mlp == "swiglu" else ("fc1", "fc2")
    for i in range(cfg.n_layers):
        b = f"blocks.{i}."
        plan[b + "attn"] = PrepareModuleInput(
            input_layouts=(between, None), desired_input_layouts=(Replicate(), None)
        )
        plan[b + "mlp"] = PrepareModuleInput(
            input_layouts=(between,), desired_input_layouts=(Replicate(),)
        )
        for name in ("wq", "wk", "wv"):
            plan[b + "attn." + name] = ColwiseParallel()
        plan[b + "attn.wo"] = RowwiseParallel(output_layouts=between)
        for name in mlp[:-1]:
            plan[b + "mlp." + name] = ColwiseParallel()
        plan[b + "mlp." + mlp[-1]] = RowwiseParallel(output_layouts=between)
        if sp:
            plan[b + "attn_norm"] = SequenceParallel()
            plan[b + "mlp_norm"] = SequenceParallel()
    return plan


def build_dtensor_model(cfg: ModelConfig, seed: int, sp: bool, world: int) -> torch.nn.Module:
    model = build_model(cfg, torch.device("cpu"), seed)  # the unsharded model, same init
    parallelize_module(model, init_device_mesh("cpu", (world,)), dtensor_plan(cfg, sp))
    if cfg.tie_embeddings:  # parallelize_module gave head and embedding separate DTensors
        model.head.weight = model.embed.tok.weight
    return model


# ---------------------------------------------------------------- bytes per collective
def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def logical_bytes(op: str, args: tuple) -> int:
    """Logical bytes of one collective call from its arguments (see the module docstring)."""
    if op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        return _nbytes(args[0]) * int(args[1])  # funcol: (input, group_size, group)
    if op in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"):
        return _nbytes(args[0])  # c10d: output first
    if op in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        return _nbytes(args[1])  # c10d: (output, input, ...)
    return _nbytes(args[0])  # all_reduce(_), reduce_scatter_tensor, broadcast, all_to_all


class CollectiveBytes(CommDebugMode):
    """CommDebugMode that also records (phase, op) -> [calls, logical bytes].

    CommDebugMode lets DTensor lower its ops first (it returns NotImplemented for DTensor
    arguments), so what arrives here with plain tensors are the collectives actually issued.
    `phase` is set by the step code (forward, backward, ...).
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.records: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and self.get_total_counts() > before:
            op = func._overloadpacket.__name__
            rec = self.records[(self.phase, op)]
            rec[0] += 1
            rec[1] += logical_bytes(op, args)
        return out

    def summary(self) -> dict:
        by_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        by_phase: dict[str, int] = defaultdict(int)
        for (phase, op), (calls, nbytes) in self.records.items():
            name = OP_NAMES.get(op, op)
            by_op[name][0] += calls
            by_op[name][1] += nbytes
            by_phase[phase] += nbytes
        return {
            "bytes": sum(by_phase.values()),
            "calls": sum(c for c, _ in by_op.values()),
            "by_op": {k: {"calls": c, "bytes": b} for k, (c, b) in sorted(by_op.items())},
            "by_phase": dict(by_phase),
            "records": [[p, o, c, b] for (p, o), (c, b) in sorted(self.records.items())],
        }


OP_NAMES = {
    "allreduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
}


# ---------------------------------------------------------------- the two sides
class Side:
    """One implementation's model, optimizer and step, with per-phase timings."""

    def __init__(self, name: str, model: torch.nn.Module, opts, train_cfg: TrainConfig) -> None:
        self.name, self.model, self.clip = name, model, opts.clip
        self.opt = build_optimizer(model, train_cfg)
        self.times: list[float] = []  # max over ranks, seconds, measured steps only
        self.block_medians: list[float] = []
        self.phases: dict[str, list[float]] = {p: [] for p in PHASES}
        self.losses: list[float] = []

    def run_step(self, x, y, counter: CollectiveBytes | None = None) -> dict[str, float]:
        raise NotImplementedError


def _mark(counter: CollectiveBytes | None, phase: str) -> None:
    if counter is not None:
        counter.phase = phase


class PlaitSide(Side):
    def __init__(self, model, comm: Comm, opts, train_cfg: TrainConfig) -> None:
        super().__init__("plait", model, opts, train_cfg)
        self.comm, self.step = comm, 0
        self.stats_last: dict = {}

    def run_step(self, x, y, counter=None) -> dict[str, float]:
        clock = time.perf_counter
        self.comm.stats.begin_step(self.step)
        t0 = clock()
        loss = self.model(x, y)
        t1 = clock()
        _mark(counter, "backward")
        loss.backward()
        t2 = clock()
        _mark(counter, "sync")
        sync_sequence_parallel_grads(self.model, self.comm)  # no-op without SP
        t3 = clock()
        _mark(counter, "clip")
        if self.clip > 0:  # clip 0 = off on both sides
            clip_tp_grad_norm_(self.model, self.comm, self.clip)
        t4 = clock()
        _mark(counter, "optim")
        self.opt.step()
        t5 = clock()
        self.opt.zero_grad(set_to_none=True)
        t6 = clock()
        self.losses.append(float(loss.detach()))
        self.stats_last = {
            "bytes_by_op": self.comm.stats.bytes_by_op(),
            "total": self.comm.stats.total(axis="tp"),
            "rows": self.comm.stats.as_rows(),
        }
        self.step += 1
        return dict(
            forward=t1 - t0,
            backward=t2 - t1,
            sync=t3 - t2,
            clip=t4 - t3,
            optim=t5 - t4,
            zero=t6 - t5,
        )


class DTensorSide(Side):
    def __init__(self, model, opts, train_cfg: TrainConfig) -> None:
        super().__init__("dtensor", model, opts, train_cfg)
        params = list(model.parameters())
        self.dparams = [p for p in params if isinstance(p, DTensor)]
        self.plain = [p for p in params if not isinstance(p, DTensor)]
        self.eager_partial = opts.dtensor_partial == "eager"

    def run_step(self, x, y, counter=None) -> dict[str, float]:
        clock = time.perf_counter
        t0 = clock()
        with loss_parallel():  # the backward must run inside it too
            loss = self.model(x, y)
            t1 = clock()
            _mark(counter, "backward")
            loss.backward()
        t2 = clock()
        _mark(counter, "sync")
        if self.eager_partial:  # reduce Partial gradients (SP norms) once, not in every use
            for p in self.dparams:
                if p.grad is not None and any(isinstance(q, Partial) for q in p.grad.placements):
                    p.grad = p.grad.redistribute(placements=[Replicate()] * len(p.placements))
        t3 = clock()
        _mark(counter, "clip")
        if self.clip > 0:
            self._clip()
        t4 = clock()
        _mark(counter, "optim")
        self.opt.step()
        t5 = clock()
        self.opt.zero_grad(set_to_none=True)
        t6 = clock()
        self.losses.append(float(loss.detach().to_local()))
        return dict(
            forward=t1 - t0,
            backward=t2 - t1,
            sync=t3 - t2,
            clip=t4 - t3,
            optim=t5 - t4,
            zero=t6 - t5,
        )

    def _clip(self) -> None:
        """clip_grad_norm_ over DTensor and plain parameters (it rejects the mix)."""
        utils = torch.nn.utils
        norm = utils.get_total_norm([p.grad for p in self.dparams if p.grad is not None])
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if self.plain:
            rest = utils.get_total_norm([p.grad for p in self.plain if p.grad is not None])
            norm = (norm.square() + rest.square()).sqrt()
        utils.clip_grads_with_norm_(self.dparams, self.clip, norm)
        if self.plain:
            utils.clip_grads_with_norm_(self.plain, self.clip, norm)


def run_block(side: Side, batches: list, steps: int, record: bool) -> None:
    block = []
    for _ in range(steps):
        x, y = batches[len(side.losses) % len(batches)]
        start = time.perf_counter()
        ph = side.run_step(x, y)
        elapsed = time.perf_counter() - start
        step_max = max_over_ranks(elapsed)  # outside the timed region; also a barrier
        if record:
            side.times.append(step_max)
            block.append(step_max)
            for k, v in ph.items():
                side.phases[k].append(v)
    if record:
        side.block_medians.append(median(block))


def counted_step(side: Side, batch) -> dict:
    with warnings.catch_warnings():  # CommDebugMode's module tracker warns about hooks
        warnings.simplefilter("ignore")
        with CollectiveBytes() as counter:
            side.run_step(*batch, counter=counter)
    return counter.summary()


def initial_param_diff(plait_model, dt_model) -> float:
    """Largest |plait shard - DTensor local shard| over all parameters (same names)."""
    theirs = dict(dt_model.named_parameters())
    worst = 0.0
    for name, p in plait_model.named_parameters():
        q = theirs[name]
        q = q.to_local() if isinstance(q, DTensor) else q
        if q.shape != p.shape:
            raise RuntimeError(f"{name}: plait shard {tuple(p.shape)} vs DTensor {tuple(q.shape)}")
        worst = max(worst, float((p.detach() - q.detach()).abs().max()))
    return worst


def make_batches(opts, vocab: int) -> list:
    """`opts.pool` batches (x, y); the same on every rank (tp ranks share their batch)."""
    g = torch.Generator().manual_seed(opts.seed + 1)
    toks = torch.randint(0, vocab, (opts.pool, opts.micro_batch, opts.seq_len + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks]


def worker(rank: int, world: int, opts: argparse.Namespace) -> dict:
    device, sp = torch.device("cpu"), opts.sequence_parallel
    cfg = get_preset(opts.model)
    check_tensor_parallel(cfg, world, sp, opts.seq_len)
    mesh = build_mesh(Layout(tp=world), device)
    comm = Comm(mesh)
    train_cfg = TrainConfig(lr=opts.lr, seq_len=opts.seq_len, micro_batch=opts.micro_batch)
    tp_model = build_model(
        cfg, device, opts.seed, parallelize=lambda m: apply_tensor_parallel(m, mesh, comm, sp)
    )
    dt_model = build_dtensor_model(cfg, opts.seed, sp, world)
    param_diff = max_over_ranks(initial_param_diff(tp_model, dt_model))
    plait_side = PlaitSide(tp_model, comm, opts, train_cfg)
    dt_side = DTensorSide(dt_model, opts, train_cfg)
    batches = make_batches(opts, cfg.vocab_size)

    load_start = os.getloadavg()
    counted = {s.name: counted_step(s, batches[0]) for s in (plait_side, dt_side)}
    plait_stats_first = plait_side.stats_last
    for side in (plait_side, dt_side):
        run_block(side, batches, opts.warmup, record=False)
    for r in range(opts.rounds):
        order = (plait_side, dt_side) if r % 2 == 0 else (dt_side, plait_side)
        for side in order:
            run_block(side, batches, opts.steps, record=True)

    n = min(len(plait_side.losses), len(dt_side.losses))
    diffs = [abs(a - b) for a, b in zip(plait_side.losses[:n], dt_side.losses[:n], strict=True)]
    local_params = {
        s.name: sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() for p in s.model.parameters()
        )
        for s in (plait_side, dt_side)
    }
    return {
        "machine": machine(),
        "config": {**vars(opts), "threads_per_rank": threads_for(world)},
        "loadavg_1_5_15": {"start": load_start, "end": os.getloadavg()},
        "local_params": local_params,
        "initial_param_max_abs_diff": param_diff,
        "first_loss": {"plait": plait_side.losses[0], "dtensor": dt_side.losses[0]},
        "final_loss": {"plait": plait_side.losses[-1], "dtensor": dt_side.losses[-1]},
        "max_loss_diff": max_over_ranks(max(diffs)),
        "comm": {
            **counted,
            "plait_comm_stats_first_step": plait_stats_first,
            "plait_comm_stats_last_step": plait_side.stats_last,
        },
        **{
            s.name: {
                **summarize(s.times),
                "phases_median_ms": {k: median(v) * 1e3 for k, v in s.phases.items()},
                "times_ms": [t * 1e3 for t in s.times],
            }
            for s in (plait_side, dt_side)
        },
        "ratio_of_medians": median(plait_side.times) / median(dt_side.times),
        "paired_block_ratio": paired_ratio(plait_side.block_medians, dt_side.block_medians),
        "block_ratios": [
            a / b for a, b in zip(plait_side.block_medians, dt_side.block_medians, strict=True)
        ],
    }


# ---------------------------------------------------------------- output
def _ops(c: dict) -> str:
    return ", ".join(f"{k} {v['calls']}× {v['bytes']:,}" for k, v in c["by_op"].items())


def report(res: dict, target: float) -> str:
    p, d, c, cm = res["plait"], res["dtensor"], res["config"], res["comm"]
    ratio = res["ratio_of_medians"]
    verdict = "meets" if ratio <= target else "misses"
    sp = "with" if c["sequence_parallel"] else "without"
    stats_bytes = cm["plait_comm_stats_first_step"]["total"][2]
    lines = [
        f"### plait TP vs DTensor TP, {sp} sequence parallelism: {c['model']}, tp {c['world']}, "
        f"batch {c['micro_batch']} x seq {c['seq_len']}, clip {c['clip']:g}, "
        f"DTensor Partial grads {c['dtensor_partial']}",
        "",
        f"Machine: {describe_machine_md(res['machine'])}; {c['threads_per_rank']} thread(s)/rank;"
        f" load average (1 min) {res['loadavg_1_5_15']['start'][0]:.1f} at start, "
        f"{res['loadavg_1_5_15']['end'][0]:.1f} at end",
        "",
        markdown_table(
            [
                "impl",
                "median step ms",
                "min ms",
                "p25 ms",
                "p75 ms",
                "steps",
                "bytes/step",
                "calls",
            ],
            [
                [
                    name,
                    s["median_ms"],
                    s["min_ms"],
                    s["p25_ms"],
                    s["p75_ms"],
                    s["steps"],
                    cm[key]["bytes"],
                    cm[key]["calls"],
                ]
                for name, key, s in (("plait", "plait", p), ("DTensor", "dtensor", d))
            ],
        ),
        "",
        f"ratio plait/DTensor (median step): **{ratio:.3f}** ({verdict} target <= {target}); "
        f"median of per-round ratios {res['paired_block_ratio']:.3f}",
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
        markdown_table(
            ["impl", *PHASES],
            [
                [n, *(s["phases_median_ms"][k] for k in PHASES)]
                for n, s in (("plait", p), ("DTensor", d))
            ],
        ),
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
                p["median_ms"],
                d["median_ms"],
                f"**{r['ratio_of_medians']:.3f}**",
                r["paired_block_ratio"],
                f"{p['min_ms']:.1f} / {d['min_ms']:.1f}",
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
    res["command"] = "python " + " ".join(sys.argv)
    print(report(res, opts.target))
    save_json(opts.json, res)


if __name__ == "__main__":
    main()
