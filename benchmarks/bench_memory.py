"""plait's memory estimate vs what runs measure, next to DeepSpeed's and Megatron's formulas.

For each layout (small-gpt and small-llama, 2 and 4 CPU ranks with gloo) the estimate
(`plait.estimate`) is compared with the memory tracker of a real run's second step, per
pipeline stage: model states by category, saved-for-backward activations at their peak, and
the tracker's peak total against the estimate's (model states plus what is alive at the
step's fullest moment, which the table names: estimate/peak.py). DeepSpeed's ZeRO-2/3
model-state formulas and Megatron's theoretical memory (transcribed in
plait/estimate/published.py) are printed for the same configuration.
Writes the markdown table of docs/memory.md; its layouts are tests/memory_table.py's list,
which the tests assert row by row.

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
from memory_table import TABLE  # noqa: E402
from plait.estimate import estimate  # noqa: E402
from plait.estimate import published as pub  # noqa: E402
from plait.estimate.rank_params import total_parameters  # noqa: E402

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
        for layout in TABLE:
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
