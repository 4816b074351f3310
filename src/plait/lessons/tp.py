"""Tensor parallelism (Megatron-LM): collectives per layer forward and backward, column vs
row split, with and without sequence parallelism.

Shoeybi et al. (2019) split each block's first Linear by columns and its second by rows, so
a block communicates only at its ends: g all-reduces the row-parallel partial sums forward,
f all-reduces the input gradient backward. Attention and MLP make four all-reduces of
b·s·h elements per layer, two forward and two backward. Sequence parallelism (Korthikanti
et al., 2022) splits each all-reduce into its halves, an all-gather and a reduce-scatter
along the sequence, and runs norms and dropout on 1/t of the tokens: the same ring traffic.
Forward and backward are separated by measurement: snapshots of the counted collectives at
the model's forward hooks within each real training step.
"""

from __future__ import annotations

from pathlib import Path

from plait.config import Config
from plait.estimate.formulas import tp_comm_per_microbatch
from plait.lessons import figures
from plait.lessons.common import lesson_config
from plait.lessons.readings import median_step_s
from plait.lessons.section import Case, CaseRun, Row, Section
from plait.lessons.tp_counts import (
    BLOCKS,
    OPS,
    Table,
    calls,
    formula_table,
    merged,
    nbytes,
    only,
    phase_tables,
    ring_bytes,
    split_bytes,
)
from plait.lessons.tp_measure import measure_tp

NAME = "tp"
TITLE = "Tensor parallelism: 2 + 2 all-reduces of b·s·h per layer, column vs row, SP"
CASES = {"tp": False, "tp-sp": True}  # label -> sequence parallelism
W = 4  # bytes per element: the lesson trains in fp32 (2·b·s·h per all-reduce in 16 bits)


def cases(quick: bool, procs: int) -> list[Case]:
    return [
        Case(label, lesson_config(quick, {"tp": procs, "sequence_parallel": sp}), measure_tp)
        for label, sp in CASES.items()
    ]


def _sizes(cfg: Config) -> tuple[int, int, int, int, int]:
    """b (sequences per micro-batch), s (tokens), h (d_model), L (layers), t (tp)."""
    t, m = cfg.train, cfg.model
    return t.micro_batch, t.seq_len, m.d_model, m.n_layers, cfg.parallel.tp


def _expected(cfg: Config, sp: bool) -> tuple[Table, Table]:
    """Forward and backward per micro-batch from the one home of the formula."""
    b, s, h, n_layers, _ = _sizes(cfg)
    fwd, bwd = tp_comm_per_microbatch(n_layers, b * s * h, b * s, sp)
    return formula_table(fwd, W), formula_table(bwd, W)


def section(runs: dict[str, CaseRun], out: Path) -> Section:
    plain, sp = runs["tp"], runs["tp-sp"]
    sec = Section(NAME, TITLE, __doc__.strip())
    sec.rows += _plain_rows(plain) + _sp_rows(sp, plain) + _split_rows(plain)
    ratio = median_step_s(sp.records) / median_step_s(plain.records)
    sec.rows.append(Row("step time SP / no SP", "measured", None, ratio, unit="x"))
    sec.notes += _notes(plain.cfg)
    sec.figures += _figures(runs, out)
    sec.raw = {
        label: {"phases": {p: _json(t) for p, t in phase_tables(run.records).items()},
                "median_step_s": median_step_s(run.records)}
        for label, run in runs.items()
    }  # fmt: skip
    sec.raw["split"] = plain.records[0]["split"]
    return sec


def _plain_rows(run: CaseRun) -> list[Row]:
    """Without SP: the four all-reduces per layer, their size, the model-level collectives."""
    b, s, h, n_layers, _ = _sizes(run.cfg)
    e = b * s * h * W
    ph = phase_tables(run.records)
    fwd, bwd = ph["forward"], ph["backward"]
    blocks = only(merged(fwd, bwd), BLOCKS)
    exp_f, exp_b = _expected(run.cfg, False)
    size = f"b·s·h·4 = {b}·{s}·{h}·4"
    return [
        Row("forward: all-reduces per layer", "2 (g after attention, g after MLP)", 2,
            calls(fwd, "all_reduce", BLOCKS) / n_layers, unit="", exact=True),
        Row("backward: all-reduces per layer", "2 (f before attention, f before MLP)", 2,
            calls(bwd, "all_reduce", BLOCKS) / n_layers, unit="", exact=True),
        Row("bytes per all-reduce (blocks)", size, e,
            nbytes(blocks, "all_reduce") / calls(blocks, "all_reduce"), exact=True),
        Row("embedding (vocab-parallel): forward all-reduce", f"{size} (partial lookups)", e,
            nbytes(fwd, "all_reduce", "tp-embed"), exact=True),
        Row("head (column-parallel over V): backward all-reduce", f"{size} (its f)", e,
            nbytes(bwd, "all_reduce", "tp-head"), exact=True),
        Row("vocab-parallel loss: forward all-reduces", "(b·s + 2·b·s)·4: max, Σexp and target",
            12 * b * s, nbytes(fwd, "all_reduce", "tp-loss"), exact=True),
        Row("vocab-parallel loss: backward", "0 (softmax − one-hot on own slice)", 0,
            nbytes(bwd, tag="tp-loss"), exact=True),
        Row("forward: every tp collective", "2L·E + E + 12·b·s (E = b·s·h·4)", nbytes(exp_f),
            nbytes(fwd), exact=True),
        Row("backward: every tp collective", "2L·E + E", nbytes(exp_b), nbytes(bwd),
            exact=True),
    ]  # fmt: skip


def _sp_rows(run: CaseRun, plain: CaseRun) -> list[Row]:
    """With SP: all-gather + reduce-scatter pairs, no activation all-reduce, same ring bytes."""
    b, s, h, n_layers, t = _sizes(run.cfg)
    e = b * s * h * W
    ph, base = phase_tables(run.records), phase_tables(plain.records)
    fwd, bwd = ph["forward"], ph["backward"]
    both = merged(fwd, bwd)
    blocks, plain_blocks = (
        only(both, BLOCKS),
        only(merged(base["forward"], base["backward"]), BLOCKS),
    )
    exp_f, exp_b = _expected(run.cfg, True)
    partial = (6 * n_layers * h + 2 * h + run.cfg.model.max_seq_len * h) * W
    pairs = [
        Row(f"SP {phase}: {op.replace('_', '-')}s per layer", "2", 2,
            calls(table, op, BLOCKS) / n_layers, unit="", exact=True)
        for phase, table in (("forward", fwd), ("backward", bwd))
        for op in ("all_gather", "reduce_scatter")
    ]  # fmt: skip
    return [
        *pairs,
        Row("SP: all-reduces of activations (forward + backward)", "0", 0,
            calls(only(both, BLOCKS, "tp-embed", "tp-head"), "all_reduce"), unit="", exact=True),
        Row("SP: bytes per all-gather and per reduce-scatter (blocks)",
            "b·s·h·4 (the full tensor)", e, nbytes(blocks) / sum(c for c, _ in blocks.values()),
            exact=True),
        Row("SP: logical bytes in the blocks / no SP's", "2 (each all-reduce became two calls)",
            2, nbytes(blocks) / nbytes(plain_blocks), unit="", exact=True),
        Row("SP: ring traffic per rank in the blocks / no SP's",
            "1: (t−1)/t·E + (t−1)/t·E = 2(t−1)/t·E", 1,
            ring_bytes(blocks, t) / ring_bytes(plain_blocks, t), unit="", exact=True),
        Row("SP: embedding and head (forward + backward)", "4·E: RS+AG (embedding), AG+RS (head)",
            4 * e, nbytes(only(both, "tp-embed", "tp-head")), exact=True),
        Row("SP forward: every tp collective", "4L·E + 2E + 12·b·s", nbytes(exp_f), nbytes(fwd),
            exact=True),
        Row("SP backward: every tp collective", "4L·E + 2E", nbytes(exp_b), nbytes(bwd),
            exact=True),
        Row("SP: partial gradients summed once per step", "(6L·h + 2h + s_max·h)·4 (GPT-2)",
            partial, nbytes(ph["step"], "all_reduce", "tp-sp-grads"), exact=True),
    ]  # fmt: skip


SPLITS = {  # arrangement -> (what, forward, backward); E = b·s·h·4, F = b·s·ffn·4
    "column": ("column (fc1 alone)", "0: f is the identity", "E: f all-reduces ∂x"),
    "row": ("row (fc2 alone)", "E: g all-reduces the partial sums", "0: g's backward: identity"),
    "paired": ("column → GELU → row (Megatron's MLP)", "E: one all-reduce (g)",
               "E: one all-reduce (f)"),
    "unpaired": ("column gathered → GELU → row split", "F + E: all-gather, then g",
                 "F + E: all-gather, then f"),
}  # fmt: skip


def _split_rows(run: CaseRun) -> list[Row]:
    """What each split of the MLP's Linears communicates, forward and backward (split.py)."""
    b, s, h, _, _ = _sizes(run.cfg)
    e, f = b * s * h * W, b * s * run.cfg.model.ffn_dim * W
    expected = {"column": (0, e), "row": (e, 0), "paired": (e, e), "unpaired": (f + e, f + e)}
    split = run.records[0]["split"]
    return [
        Row(
            f"{what}: {phase}",
            formula,
            expected[name][i],
            split_bytes(split, name, phase)[1],
            exact=True,
        )
        for name, (what, *formulas) in SPLITS.items()
        for i, (phase, formula) in enumerate(zip(("forward", "backward"), formulas, strict=True))
    ]


def _notes(cfg: Config) -> list[str]:
    b, s, h, n_layers, t = _sizes(cfg)
    return [
        f"b = {b} sequences per micro-batch, s = {s} tokens, h = {h} (d_model), L = {n_layers} "
        f"layers, t = {t} tp ranks, ffn = {cfg.model.ffn_dim}. E = b·s·h·4 = {b * s * h * W:,} B: "
        "the activations are fp32 here; in bf16 or fp16 E is the course's 2·b·s·h.",
        "Bytes are logical, as comm.stats counts them: an all-reduce its buffer, an all-gather "
        "its output, a reduce-scatter its input. A ring puts 2(t−1)/t of an all-reduce's buffer "
        "on each rank's link and (t−1)/t of an all-gather's or reduce-scatter's, so SP's pair "
        "moves what the all-reduce moved, though its logical count is twice as large.",
        "Forward and backward are measured apart, inside the real training step: the counted "
        "collectives are snapshotted at the model's forward pre-hook and forward hook and when "
        "the micro-batches end (lessons/phases.py). Once per step come the gradient norm's "
        "float64 all-reduce (8 B) and, under SP, the one flat all-reduce of the partial "
        "gradients of parameters replicated over tp (norm gains and biases, the row-parallel "
        "biases, the position table).",
        "Column vs row: plait's ColumnParallelLinear and RowParallelLinear at the MLP's shapes "
        f"(h = {h} → ffn = {cfg.model.ffn_dim} → h), run once forward and backward on the same "
        "ranks (lessons/column_row.py). Paired, the column's output slice is the row's input "
        "slice: one all-reduce each way per block instead of two all-gathers of b·s·ffn more.",
        "Full recomputation would re-run each block's forward in the backward and with it the "
        "forward's two all-reduces per layer; the lesson runs without it.",
    ]


def _figures(runs: dict[str, CaseRun], out: Path) -> list[Path]:
    tables = {label: phase_tables(run.records) for label, run in runs.items()}
    n_layers = runs["tp"].cfg.model.n_layers
    groups = [f"{phase}, {'SP' if sp else 'no SP'}" for sp in (False, True)
              for phase in ("forward", "backward")]  # fmt: skip
    per_layer = {op.replace("_", "-"): [calls(tables[label][phase], op, BLOCKS) / n_layers
                                         for label in CASES for phase in ("forward", "backward")]
                 for op in OPS}  # fmt: skip
    t = runs["tp"].cfg.parallel.tp
    totals = {label: merged(tb["forward"], tb["backward"]) for label, tb in tables.items()}
    by_op = {("SP" if CASES[label] else "no SP"):
             [nbytes(tb, op) / 1e3 for op in OPS] + [ring_bytes(tb, t) / 1e3]
             for label, tb in totals.items()}  # fmt: skip
    split = runs["tp"].records[0]["split"]
    phases = ("forward", "backward")
    return [
        figures.bars(out / "tp-collectives.png", groups, per_layer,
                     "collectives per layer in the blocks, one micro-batch", "calls per layer"),
        figures.bars(out / "tp-bytes.png", [*OPS, "ring, per rank"], by_op,
                     "tp bytes of one micro-batch, forward + backward: logical by op, and on the "
                     "wire", "kB"),
        figures.bars(out / "tp-split.png", list(SPLITS),
                     {p: [split_bytes(split, n, p)[1] / 1e3 for n in SPLITS] for p in phases},
                     "one MLP's Linears split by column, by row, paired and unpaired", "kB"),
    ]  # fmt: skip


def _json(table: Table) -> dict[str, list[int]]:
    return {f"{op} {tag}": [c, n] for (op, tag), (c, n) in sorted(table.items())}
