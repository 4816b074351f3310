"""plait's memory estimate vs what runs measure, next to DeepSpeed's and Megatron's formulas.

For each layout (small-gpt and small-llama, 2 and 4 CPU ranks with gloo) the estimate
(`plait.estimate`) is compared with the memory tracker of a real run's second step, per
pipeline stage: model states by category, saved-for-backward activations at their peak, and
the tracker's peak total against the estimate's (model states plus what is alive at the
step's fullest moment, which the table names: estimate/peak.py). DeepSpeed's ZeRO-2/3
model-state formulas and Megatron's theoretical memory (transcribed in
plait/estimate/published.py) are printed for the same configuration.
Writes the markdown table of docs/memory.md.

    .venv/bin/python benchmarks/bench_memory.py > benchmarks/results/memory_table.md
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from harness import World  # noqa: E402
from memory_runs import Case, compare, error, measure  # noqa: E402
from plait.estimate import estimate  # noqa: E402
from plait.estimate import published as pub  # noqa: E402
from plait.estimate.rank_params import total_parameters  # noqa: E402

LORA = {"lora_rank": 4, "lora_targets": "all"}
LAYOUTS = [
    Case("dp2", parallel={"dp": 2}),
    Case("dp2 ZeRO-1 bf16", parallel={"dp": 2, "zero": 1, "precision": "bf16"}),
    Case("dp2 ZeRO-2 bf16", "small-llama", parallel={"dp": 2, "zero": 2, "precision": "bf16"}),
    Case("dp2 ZeRO-3 bf16", parallel={"dp": 2, "zero": 3, "precision": "bf16"}),
    Case("dp2 ZeRO-2 cpu offload", "small-llama", parallel={"dp": 2, "zero": 2, "offload": "cpu"}),
    Case("dp2 ZeRO-1 nvme offload", parallel={"dp": 2, "zero": 1, "offload": "nvme"}),
    Case("dp2 recompute full", parallel={"dp": 2, "recompute": "full"}),
    Case(
        "dp2 recompute selective, dropout",
        "small-llama",
        parallel={"dp": 2, "recompute": "selective"},
        model={"dropout": 0.1},
    ),
    Case("tp2", parallel={"tp": 2}),
    Case("tp2 SP", parallel={"tp": 2, "sequence_parallel": True}),
    Case(
        "tp2 SP bf16 selective",
        "small-llama",
        parallel={
            "tp": 2,
            "sequence_parallel": True,
            "precision": "bf16",
            "recompute": "selective",
        },
    ),
    Case("pp2 gpipe", parallel={"pp": 2, "schedule": "gpipe"}, accum=4),
    Case("pp2 1f1b", parallel={"pp": 2, "schedule": "1f1b"}, accum=4),
    Case(
        "pp2 interleaved v2",
        "small-llama",
        parallel={"pp": 2, "schedule": "interleaved", "virtual_stages": 2},
        accum=4,
    ),
    Case(
        "dp2 tp2 SP ZeRO-1 bf16",
        parallel={"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1, "precision": "bf16"},
    ),
    Case("dp2 pp2 1f1b ZeRO-1", "small-llama", parallel={"dp": 2, "pp": 2, "zero": 1}, accum=4),
    Case("pp4 1f1b", parallel={"pp": 4}, accum=8),
    # issue 23: the moment of the peak, and the new features
    Case("dp2 ZeRO-3 cpu offload", "small-llama", parallel={"dp": 2, "zero": 3, "offload": "cpu"}),
    Case("dp2 ZeRO-3 recompute full", parallel={"dp": 2, "zero": 3, "recompute": "full"}),
    Case("LoRA dp2 ZeRO-3", "small-llama", parallel={"dp": 2, "zero": 3}, model=LORA),
    Case(
        "LoRA dp2 ZeRO-3 bf16",
        "small-llama",
        parallel={"dp": 2, "zero": 3, "precision": "bf16", "base_dtype": "bf16"},
        model=LORA,
    ),
    Case(
        "LoRA dp2 ZeRO-3 recompute full",
        "small-llama",
        parallel={"dp": 2, "zero": 3, "recompute": "full"},
        model=LORA,
    ),
    Case("dp2 offload activations", parallel={"dp": 2, "offload_activations": "cpu"}),
    Case(
        "pp2 offload activations, recompute full",
        "small-llama",
        parallel={"pp": 2, "offload_activations": "cpu", "recompute": "full"},
        accum=4,
    ),
    Case("pp2 zb-h1", parallel={"pp": 2, "schedule": "zb-h1"}, accum=4),
    Case("pp2 2bw", parallel={"pp": 2, "schedule": "2bw"}, accum=4, steps=4),
    Case(
        "pp2 2bw offload activations",
        parallel={"pp": 2, "schedule": "2bw", "offload_activations": "cpu"},
        accum=4,
        steps=4,
    ),
    Case(
        "dp2 pp2 1f1b ZeRO-3",
        "small-llama",
        parallel={"dp": 2, "pp": 2, "zero": 3},
        accum=4,
    ),
    Case(
        "tp2 partitioned activations, recompute full",
        parallel={"tp": 2, "partition_activations": True, "recompute": "full"},
    ),
    Case(
        "dp2 tp2 ZeRO-3 partitioned, recompute full",
        parallel={"dp": 2, "tp": 2, "zero": 3, "partition_activations": True, "recompute": "full"},
    ),
    Case(
        "tp2 SP bf16 (lighter loss)",
        "small-llama",
        parallel={"tp": 2, "sequence_parallel": True, "precision": "bf16"},
    ),
]
STATES = ("parameters", "gradients", "master_weights", "optimizer_states")


def _cell(pair: tuple[int, int]) -> str:
    est, meas = pair
    return f"{est:,} / {meas:,} ({100 * error(pair):+.2f}%)"


def _row(case: Case, est, measured: dict) -> str:
    pairs = compare(est, measured)
    states = tuple(sum(pairs[c][i] for c in STATES) for i in (0, 1))
    worst = max(abs(error(pairs[c])) for c in STATES)
    cells = [_cell(states), f"{100 * worst:.2f}%", _cell(pairs["activations"])]
    cells += [_cell(pairs["total"]), est.ranks[measured["pp_rank"]].peak_moment().name]
    cells += [_published(case)]
    return f"| {case.name} | {measured['pp_rank']} | " + " | ".join(cells) + " |"


def _published(case: Case) -> str:
    """DeepSpeed ZeRO-2 and ZeRO-3 model states per GPU (N = dp), Megatron's states and
    activations (distributed optimizer when plait shards optimizer states)."""
    cfg = case.config("/tmp/x")
    par, psi = cfg.parallel, total_parameters(cfg.model)
    offload = par.offload != "none"
    ds2 = pub.deepspeed_zero2_gpu(psi, par.dp, offload)
    layer = pub.largest_layer(cfg)
    ds3 = pub.deepspeed_zero3_gpu(psi, layer, par.dp, "optimizer" if offload else "none")
    mw = pub.megatron_weights_and_optimizer(cfg, par.zero >= 1)
    ma = pub.megatron_activations(cfg)
    return f"{ds2:,} / {ds3:,} | {mw:,.0f} + {ma:,.0f}"


def main() -> None:
    worlds: dict[int, World] = {}
    cols = ["layout", "stage", "model states: estimate / measured", "worst state category"]
    cols += ["activations", "total (tracker peak)", "the estimate's peak moment"]
    cols += ["DeepSpeed ZeRO-2 / ZeRO-3", "Megatron"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    with tempfile.TemporaryDirectory() as tmp:
        for layout in LAYOUTS:
            world = worlds.get(layout.world) or worlds.setdefault(layout.world, World(layout.world))
            est = estimate(layout.config(str(Path(tmp) / "nvme")))
            seen = set()
            for measured in world.run(measure, layout, tmp):
                if measured["pp_rank"] in seen:
                    continue
                seen.add(measured["pp_rank"])
                print(_row(layout, est, measured))
    for w in worlds.values():
        w.close()


if __name__ == "__main__":
    main()
