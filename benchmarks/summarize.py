"""Collect saved benchmark JSON files into the markdown tables of BENCHMARKS.md.

    .venv/bin/python benchmarks/summarize.py benchmarks/results/*.json

Files written by bench_dp.py (they have a "ddp" entry) and bench_single.py (a "plain" entry)
go to separate tables; nothing here is measured, it only reformats what the runs saved.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from output import comparison_cells, ddp_bucket_sizes, describe_machine_md, markdown_table


def dp_row(name: str, r: dict) -> list:
    c, p, d = r["config"], r["plait"], r["ddp"]
    setup = (
        f"{c['model']} b{c['micro_batch']} s{c['seq_len']} acc{c['accum']} {c['data']}"
        f" clip{c['clip']:g}" + (" grad_view" if c.get("ddp_grad_view") else "")
    )
    return [
        name,
        setup,
        *comparison_cells(r, p, d),
        f"{p['buckets']} / {len(ddp_bucket_sizes(d))}",
        p["grad_allreduce_bytes_per_step"],
        f"{r['max_loss_diff']:.1e}",
    ]


def single_row(name: str, r: dict) -> list:
    c, p, q = r["config"], r["plait"], r["plain"]
    data = c["data"] if c["plait"] == "dp" else "real"
    setup = f"{c['model']} b{c['micro_batch']} s{c['seq_len']} acc{c['accum']} {data}"
    return [
        name,
        c["plait"],
        setup,
        c["threads"],
        *comparison_cells(r, p, q),
        f"{r['max_loss_diff']:.1e}",
    ]


PHASES = ("forward", "backward", "finish", "clip", "optim", "zero")


def phase_rows(name: str, r: dict) -> list[list]:
    """Rank 0's median time per phase; DDP waits for its buckets inside backward."""
    return [
        [name, impl, *(r[key]["phases_median_ms"][ph] for ph in PHASES)]
        for impl, key in (("plait", "plait"), ("DDP", "ddp"))
    ]


def main(paths: list[str]) -> None:
    dp_rows, single_rows, machines, phases = [], [], set(), []
    for path in sorted(paths):
        r = json.loads(Path(path).read_text())
        if "ddp" not in r and "plain" not in r:
            continue  # not a comparison (e.g. profile_dp_hooks.py output)
        machines.add(describe_machine_md(r["machine"]))
        name = Path(path).stem
        if "ddp" in r:
            phases += phase_rows(name, r)
        (dp_rows if "ddp" in r else single_rows).append(
            dp_row(name, r) if "ddp" in r else single_row(name, r)
        )
    for m in sorted(machines):
        print(f"Machine: {m}\n")
    if dp_rows:
        header = [
            "run",
            "setup",
            "plait median ms",
            "DDP median ms",
            "plait/DDP",
            "per-round",
            "min ms plait / DDP",
            "buckets plait / DDP",
            "bytes/step",
            "max abs Δloss",
        ]
        print("### Data parallel: plait vs DDP (step time = max over ranks)\n")
        print(markdown_table(header, dp_rows) + "\n")
        print("### Median time per phase on rank 0 (ms; DDP waits for buckets in backward)\n")
        print(markdown_table(["run", "impl", *PHASES], phases) + "\n")
    if single_rows:
        header = [
            "run",
            "plait side",
            "setup",
            "threads",
            "plait median ms",
            "plain median ms",
            "plait/plain",
            "per-round",
            "min ms plait / plain",
            "max abs Δloss",
        ]
        print("### Single process: plait vs a plain PyTorch loop\n")
        print(markdown_table(header, single_rows))


if __name__ == "__main__":
    main(sys.argv[1:])
