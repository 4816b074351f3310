"""Does `plait plan` rank layouts as they run? Calibrate, plan, run, compare.

1. `plait calibrate --ranks 4` measures this machine (or `--hardware FILE` reuses a profile).
2. The planner ranks every layout of the model over the ranks (best settings per cut).
3. `--layouts` of them, spread evenly over the ranking (best to worst), run for real as
   `plait train --config` subprocesses for `--steps` steps, in `--rounds` alternating rounds
   (every layout once per round, so a slow spell of the shared machine touches them all); a
   layout's measured step time is the median over its rounds' steps after the first `--skip`.
4. Spearman's rank correlation of predicted and measured times, and each layout's error,
   go to a markdown table (printed; with `--write`, into BENCHMARKS.md between the
   `plan-benchmark` markers, with the machine and the date).

    .venv/bin/python benchmarks/bench_plan.py --layouts 10 --steps 12 --write
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine
from output import describe_machine_md, markdown_table, save_json
from plait.models.presets import get_preset
from plait.plan.enumerate import Request
from plait.plan.hardware import load_hardware
from plait.plan.search import Ranked, plan
from plait.plan.toml_out import plan_sections

ROOT = Path(__file__).resolve().parent.parent
PLAIT = str(Path(sys.executable).with_name("plait"))
BEGIN, END = "<!-- plan-benchmark:begin -->", "<!-- plan-benchmark:end -->"


def spread(ranked: list[Ranked], k: int) -> list[Ranked]:
    """k layouts evenly spaced over the ranking, the best and the worst included."""
    if len(ranked) <= k:
        return ranked
    idx = sorted({round(i * (len(ranked) - 1) / (k - 1)) for i in range(k)})
    return [ranked[i] for i in idx]


def measure(r: Ranked, steps: int, skip: int, work: Path) -> list[float]:
    """Step times of a `plait train` run of the layout (the first `skip` left out)."""
    import tomli_w

    cfg = work / "plan.toml"
    cfg.write_text(tomli_w.dumps(plan_sections(r)))
    out = work / "run"
    cmd = [PLAIT, "train", "--config", str(cfg), "--steps", str(steps), "--eval-every", "0"]
    cmd += ["--eval-batches", "1", "--no-save", "--no-progress", "--overwrite", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x["step_time_s"] for x in rows if "step_time_s" in x][skip:]


def spearman(a: list[float], b: list[float]) -> float:
    """Pearson's correlation of the ranks (no ties among measured float times)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def calibrate(args: argparse.Namespace, work: Path) -> str:
    if args.hardware:
        return args.hardware
    path = work / "hardware.toml"
    cmd = [PLAIT, "calibrate", "--ranks", str(args.ranks), "--out", str(path)]
    cmd += ["--model", args.model, "--seq-len", str(args.seq_len)]
    subprocess.run(cmd, check=True)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--model", default="small-gpt")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layouts", type=int, default=10)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per layout")
    ap.add_argument("--hardware", help="a profile to reuse instead of calibrating")
    ap.add_argument("--json", default="benchmarks/results/plan.json")
    ap.add_argument("--write", action="store_true", help="put the table into BENCHMARKS.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="plait-bench-plan-") as d:
        work = Path(d)
        hw_path = calibrate(args, work)
        hw = load_hardware(hw_path)
        hw_text = Path(hw_path).read_text()
        req = Request(
            get_preset(args.model),
            args.model,
            args.ranks,
            args.ranks,
            args.global_batch,
            args.seq_len,
            hw.precision,
        )
        ranked = plan(req, hw, hw.memory, top=10_000).ranked
        chosen = spread(ranked, args.layouts)
        times: list[list[float]] = [[] for _ in chosen]
        for k in range(args.rounds):
            for i, r in enumerate(chosen):
                times[i] += measure(r, args.steps, args.skip, work)
                print(f"round {k + 1}: {r.candidate.describe():45s} predicted "
                      f"{r.time.total * 1e3:7.1f} ms, measured "
                      f"{statistics.median(times[i]) * 1e3:7.1f} ms", flush=True)  # fmt: skip
        rows = [(r.candidate.describe(), r.time.total, statistics.median(t), vars(r.time))
                for r, t in zip(chosen, times, strict=True)]  # fmt: skip
    report(args, rows, len(ranked), hw_text)


def report(args: argparse.Namespace, rows: list, n_ranked: int, hw_text: str) -> None:
    pred, meas = [r[1] for r in rows], [r[2] for r in rows]
    rho = spearman(pred, meas)
    errors = [abs(p - m) / m for p, m in zip(pred, meas, strict=True)]
    table = markdown_table(
        ["layout (ranked best first)", "predicted ms", "measured ms", "error"],
        [(n, p * 1e3, m * 1e3, f"{(p - m) / m:+.0%}") for n, p, m, _ in rows],
    )
    within = sum(e <= 0.30 for e in errors)
    res = {
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "rows": rows,
        "spearman": rho,
        "errors": errors,
        "ranked": n_ranked,
    }
    text = (
        f"`plait plan --model {args.model} --gpus {args.ranks} --global-batch "
        f"{args.global_batch} --seq-len {args.seq_len}` with this machine's calibrated profile "
        f"ranked {n_ranked} layouts; {len(rows)} of them, evenly spread over the ranking, ran "
        f"{args.steps} steps each in {args.rounds} alternating rounds (median of the steps "
        f"after the first {args.skip} of each run). Machine: "
        f"{describe_machine_md(res['machine'])}; {res['date']}.\n\n{table}\n\n"
        f"Spearman rank correlation {rho:.2f} (target 0.8); {within} of {len(rows)} "
        f"predictions within 30% (largest error {max(errors):.0%}).\n"
    )
    print(text)
    save_json(args.json, {**res, "hardware_toml": hw_text})
    if args.write:
        path = ROOT / "BENCHMARKS.md"
        doc = path.read_text()
        block = f"{BEGIN}\n{text}{END}"
        if BEGIN in doc:
            doc = doc[: doc.index(BEGIN)] + block + doc[doc.index(END) + len(END) :]
        else:
            doc += f"\n## Planner: predicted vs measured step time\n\n{block}\n"
        path.write_text(doc)


if __name__ == "__main__":
    main()
