"""plait checkpoints vs torch.distributed.checkpoint (DCP) of a plain state dict: save and load
time, and the bytes on disk, for one model under several layouts.

Per layout (`ckpt_sides.LAYOUTS`: dp2 with ZeRO-3, dp2 x tp2, pp2 with 1F1B), one world of
the right size builds `plait.train.Trainer` from `build_config(preset, overrides)` and the
default corpus, trains `--train-steps` steps (so the moments hold real values), then times
side by side, in one process group:
  plait save: `Trainer.save(out)` (boxes by single-process name, ShardedTensors, DCP, then
              rank 0's manifest with SHA-256 and the commit marker, and the pruning)
  floor save: `dcp.save` of the same fp32 masters and AdamW moments as plain rank-local
              tensors under rank-prefixed names (each element once; `ckpt_sides` says how)
  plait load: `Trainer.load(path)` into the same layout (full tensors read, slices kept)
  floor load: `dcp.load` of those plain tensors in place into the engine's buffers
After warm-up the pairs (save, save) and (load, load) alternate in blocks of `--block`
calls, the order flipping every round. A call is timed on every rank; its figure is the max
over ranks. Before every save the previous folder is removed (untimed), so both sides
always write a new folder. Then rank 0 measures both folders and the checkpoint's tensors
against 3 x params x 4 bytes (fp32 master + two moments).

    .venv/bin/python benchmarks/bench_ckpt.py --out benchmarks/results/ckpt_x.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_sides import (
    LAYOUTS,
    LOAD_PHASES,
    SAVE_PHASES,
    CallSide,
    call_step,
    folder_facts,
    held_bytes,
    local_pieces,
    make_config,
    make_sides,
    make_trainer,
    param_count,
    world_of,
)
from common import (
    alternate,
    gather_objects,
    machine,
    max_over_ranks,
    pair_ratios,
    spawn,
    summarize,
    threads_for,
)
from output import describe_machine_md, markdown_table, phase_table, publish
from plait.build.corpus import corpus_from_tokens
from plait.data import load_tokens
from plait.train import Trainer


def shared_root(parent: str | None) -> Path:
    """A fresh temporary folder made by rank 0, its path given to every rank."""
    box = [tempfile.mkdtemp(prefix="plait-bench-ckpt-", dir=parent) if dist.get_rank() == 0
           else None]  # fmt: skip
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def snapshot(trainer: Trainer) -> list[torch.Tensor]:
    """A copy of every state this rank holds: loads of the same checkpoint must restore it."""
    return [v.clone() for _, views in local_pieces(trainer) for v in views.values()]


def restored_diff(trainer: Trainer, before: list[torch.Tensor]) -> float:
    """Largest |state now - state before the timing|, max over ranks: 0 if every save and
    load of both sides wrote and read back the same values."""
    now = [v for _, views in local_pieces(trainer) for v in views.values()]
    diff = max((float((a - b).abs().max()) for a, b in zip(now, before, strict=True)
                if a.numel()), default=0.0)  # fmt: skip
    return max_over_ranks(diff)


def side_result(side: CallSide) -> dict[str, Any]:
    """One side's call times (ms; every call kept) and its extra figures' medians."""
    return {"name": side.name, **summarize(side.times), "times_ms": side.times_ms(),
            "phases_median_ms": side.phase_medians_ms()}  # fmt: skip


def pair_result(a: CallSide, b: CallSide) -> dict[str, Any]:
    """plait's side, the floor's, and plait/floor by medians and by back-to-back blocks."""
    return {"plait": side_result(a), "floor": side_result(b), **pair_ratios(a, b)}


def on_disk(root: Path, trainer: Trainer) -> dict[str, Any] | None:
    """Both folders, measured on rank 0 (None elsewhere)."""
    if dist.get_rank() != 0:
        return None
    plait = root / "plait" / "checkpoints" / f"step-{trainer.step}"
    return {"plait": folder_facts(plait), "floor": folder_facts(root / "floor")}


def worker(rank: int, world: int, opts: argparse.Namespace, layout: str) -> dict[str, Any]:
    """One rank of one layout's world: build, train, time both pairs, measure, clean up."""
    cfg = make_config(layout, opts)
    corpus = corpus_from_tokens(load_tokens(None, cfg.data.max_bytes), cfg)
    trainer = make_trainer(cfg, corpus, opts.train_steps)
    root = shared_root(opts.dir)
    before = snapshot(trainer)
    pairs = make_sides(trainer, root)
    alternate(pairs, call_step, warmup=opts.warmup, rounds=opts.rounds, steps=opts.block)
    dist.barrier()
    (save_a, save_b), (load_a, load_b) = pairs  # the order make_sides gives
    psi = param_count(cfg)
    out = {
        "layout": layout,
        "world": world,
        "parallel": LAYOUTS[layout],
        "params": psi,
        "expected_bytes": 3 * psi * 4,
        "held_bytes_per_rank": gather_objects(held_bytes(trainer)),
        "save": pair_result(save_a, save_b),
        "load": pair_result(load_a, load_b),
        "restored_max_abs_diff": restored_diff(trainer, before),
        "on_disk": on_disk(root, trainer),
    }
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    trainer.close()
    return out


def run_all(opts: argparse.Namespace) -> dict[str, Any]:
    """One world per layout, one after another (never two at once on the machine)."""
    results = {}
    for layout in opts.layouts:
        world = world_of(layout)
        print(f"{layout}: world {world} ...", flush=True)
        results[layout] = spawn(worker, world, opts, layout)
    return {
        "machine": machine(),
        "config": {
            **vars(opts),
            "threads_per_rank": {k: threads_for(world_of(k)) for k in opts.layouts},
        },
        "layouts": results,
    }


# ---------------------------------------------------------------- report
TIME_HEAD = (
    "layout,world,plait save ms,floor save ms,save plait/floor,per-round,plait load ms,"
    "floor load ms,load plait/floor,per-round,plait save ms (own clock),calls/side"
)
BYTES_HEAD = (
    "layout,params Ψ,3 × 4 B × Ψ,plait tensor data,plait .distcp per rank,plait .metadata,"
    "plait other files,plait total,floor tensor data,floor .distcp per rank,floor .metadata,"
    "floor total,held by all ranks,tensors / chunks plait,tensors / chunks floor"
)


def _ms(s: dict[str, Any]) -> float:
    return s["median_ms"]


def time_rows(res: dict[str, Any]) -> list[list[Any]]:
    """Medians (max over ranks per call), both ratios, for save and for load."""
    rows = []
    for name, r in res["layouts"].items():
        s, ld = r["save"], r["load"]
        rows.append([
            name, r["world"], _ms(s["plait"]), _ms(s["floor"]), f"**{s['ratio_of_medians']:.2f}**",
            s["paired_block_ratio"], _ms(ld["plait"]), _ms(ld["floor"]),
            f"**{ld['ratio_of_medians']:.2f}**", ld["paired_block_ratio"],
            s["plait"]["phases_median_ms"]["own_clock"], s["plait"]["steps"],
        ])  # fmt: skip
    return rows


def _per_rank(xs: list[int]) -> str:
    return " / ".join(f"{x:,}" for x in xs)


def bytes_rows(res: dict[str, Any]) -> list[list[Any]]:
    """What is on disk next to what the state is: 3 fp32 tensors of Ψ elements."""
    rows = []
    for name, r in res["layouts"].items():
        p, f = r["on_disk"]["plait"], r["on_disk"]["floor"]
        rows.append([
            name, r["params"], r["expected_bytes"], p["tensor_data_bytes"],
            _per_rank(p["per_rank_bytes"]), p["metadata_bytes"], sum(p["other_bytes"].values()),
            p["total_bytes"], f["tensor_data_bytes"], _per_rank(f["per_rank_bytes"]),
            f["metadata_bytes"], f["total_bytes"], sum(r["held_bytes_per_rank"]),
            f"{p['tensors']} / {p['chunks']}", f"{f['tensors']} / {f['chunks']}",
        ])  # fmt: skip
    return rows


def _plait_sides(res: dict[str, Any], op: str) -> list[tuple[str, dict[str, Any]]]:
    return [(name, r[op]["plait"]) for name, r in res["layouts"].items()]


def report(res: dict[str, Any]) -> str:
    """The markdown printed at the end of a run (the JSON holds every call time)."""
    c = res["config"]
    first = next(iter(res["layouts"].values()))
    threads = ", ".join(f"{k} {v}" for k, v in c["threads_per_rank"].items())
    diffs = ", ".join(f"{k} {r['restored_max_abs_diff']:.1e}" for k, r in res["layouts"].items())
    return "\n\n".join(
        [
            f"### Checkpoints: plait vs torch.distributed.checkpoint of a plain state_dict: "
            f"{c['preset']} ({first['params']:,} params), fp32, after {c['train_steps']} "
            f"step(s); micro-batch {c['micro_batch']}, global batch {c['global_batch']}, "
            f"seq {c['seq_len']}",
            f"Machine: {describe_machine_md(res['machine'])}; thread(s)/rank: {threads}. "
            f"{c['warmup']} warm-up call(s) per side, then {c['rounds']} rounds of blocks of "
            f"{c['block']} call(s) per side, order flipped every round.",
            "Time per call (max over ranks), median ms; per-round: median of the ratios of "
            "back-to-back blocks; own clock: the `seconds` Trainer.save returns (max over ranks):",
            markdown_table(TIME_HEAD.split(","), time_rows(res)),
            "Bytes on disk (rank 0 lists both folders after the last save; tensor data: "
            "elements x 4 B of every chunk DCP's metadata lists):",
            markdown_table(BYTES_HEAD.split(","), bytes_rows(res)),
            "plait's phases, median ms per call of the max over ranks (`ckpt_sides` names "
            "them; manifest: rank 0 alone):",
            phase_table("save", SAVE_PHASES, _plait_sides(res, "save")),
            phase_table("load", LOAD_PHASES, _plait_sides(res, "load")),
            f"State after every save and load, max |now - before timing| over ranks: {diffs}",
        ]
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small-gpt", help="plait model preset")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, among "
                    + ", ".join(LAYOUTS))  # fmt: skip
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--global-batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus bytes read")
    ap.add_argument("--train-steps", type=int, default=1, help="steps before any save")
    ap.add_argument("--warmup", type=int, default=2, help="unrecorded calls per side")
    ap.add_argument("--rounds", type=int, default=15, help="alternating rounds")
    ap.add_argument("--block", type=int, default=2, help="calls per side per block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="parent of the temporary checkpoint folders")
    ap.add_argument("--out", default=None, help="save JSON here")
    opts = ap.parse_args(argv)
    opts.layouts = [s.strip() for s in opts.layouts.split(",") if s.strip()]
    if any(s not in LAYOUTS for s in opts.layouts) or opts.warmup < 1 or opts.rounds < 1:
        ap.error(f"--layouts must be among {', '.join(LAYOUTS)}, --warmup and --rounds >= 1")
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    res = run_all(opts)
    publish(res, report(res), opts.out)


if __name__ == "__main__":
    main()
