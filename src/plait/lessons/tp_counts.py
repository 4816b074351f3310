"""Reading the tensor-parallel lesson's records: collectives per phase of a micro-batch, by
(op, tag), and the ring traffic a logical byte count stands for.

`measure_tp` keeps, per step, the phases in order (forward and backward once per
micro-batch, then the step's once-per-step work); counts are per rank and identical on every
tp rank, so rank 0's last step is read.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

Table = dict[tuple[str, str], tuple[int, int]]
"""(op, tag) -> (calls, logical bytes)."""

BLOCKS = "tp"  # the tag of the collectives inside the transformer blocks (f, g, SP's pairs)
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def phase_tables(records: list[dict[str, Any]], axis: str = "tp") -> dict[str, Table]:
    """{"forward", "backward": per micro-batch; "step": once per step} on `axis`, from rank
    0's last step (the micro-batches of a step are alike: the totals divide exactly)."""
    phases = records[0]["steps"][-1]["phases"]
    micro = sum(p["phase"] == "forward" for p in phases)
    out: dict[str, Table] = {"forward": {}, "backward": {}, "step": {}}
    for p in phases:
        table = out.setdefault(p["phase"], {})
        for c in p["counts"]:
            if c["axis"] == axis:
                calls, nbytes = table.get((c["op"], c["tag"]), (0, 0))
                table[(c["op"], c["tag"])] = (calls + c["calls"], nbytes + c["bytes"])
    for phase in ("forward", "backward"):
        out[phase] = {k: (c // micro, b // micro) for k, (c, b) in out[phase].items()}
    return out


def merged(*tables: Table) -> Table:
    """The sum of tables (forward + backward)."""
    out: Table = {}
    for table in tables:
        for k, (c, n) in table.items():
            c0, n0 = out.get(k, (0, 0))
            out[k] = (c0 + c, n0 + n)
    return out


def only(table: Table, *tags: str) -> Table:
    return {k: v for k, v in table.items() if k[1] in tags}


def calls(table: Table, op: str, tag: str | None = None) -> int:
    return sum(c for (o, t), (c, _) in table.items() if o == op and tag in (None, t))


def nbytes(table: Table, op: str | None = None, tag: str | None = None) -> int:
    return sum(b for (o, t), (_, b) in table.items() if op in (None, o) and tag in (None, t))


def ring_factor(op: str, t: int) -> Fraction:
    """Bytes each rank sends per logical byte in a ring of t ranks: an all-reduce is a
    reduce-scatter then an all-gather, each moving (t-1)/t of the buffer."""
    return Fraction(2 * (t - 1), t) if op == "all_reduce" else Fraction(t - 1, t)


def ring_bytes(table: Table, t: int, tag: str | None = None) -> float:
    """What the ring puts on each rank's link for the logical bytes in `table`."""
    return float(sum(ring_factor(op, t) * nbytes(table, op, tag) for op in OPS))


def formula_table(fwd_bwd: dict[tuple[str, str], tuple[int, int]], width: int) -> Table:
    """estimate.formulas' {(op, tag): (calls, elements)} in bytes of `width`."""
    return {k: (c, e * width) for k, (c, e) in fwd_bwd.items()}


def split_bytes(split: dict[str, Any], name: str, phase: str) -> tuple[int, int]:
    """(calls, logical bytes) of arrangement `name`'s `phase` in the column/row probes."""
    rows = split[name][phase]
    return sum(r["calls"] for r in rows), sum(r["bytes"] for r in rows)
