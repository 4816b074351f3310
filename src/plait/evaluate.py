"""`plait eval` on every rank: a model's token-weighted loss over every row of a dataset.

It is validation during training, run over the whole dataset instead of a held-out share: the
model is built in the requested layout exactly as `plait train` builds it (any dp, tp, pp,
ZeRO stage), its weights come from `--init-from` (a Hugging Face folder) or a checkpoint
written in any layout, every row is evaluated once (the replicas split them; pipeline stages
pass them on), and the figure is the sum of the target tokens' cross entropy divided by their
count (`step.evaluate_totals`): the number transformers gives for the same examples with -100
on the prompt, summed over target tokens and divided by their count. Examples are packed with
the block-causal mask (`data/packing.py`), which computes what running them one by one would.

The launcher (`cli/evaluate.py`) checks the request and prepares raw files into a temporary
examples folder first; the workers only read prepared data.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console

from plait.config import Config
from plait.data.batches import Corpus
from plait.data.examples import ExampleRows, ExampleStore, is_examples_dir
from plait.data.packing import assign_rows, dropped_reason
from plait.data.sampler import Rows, TokenWindows
from plait.data.stream import load_stream
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.microbatch import MicroBatch
from plait.step import evaluate_totals
from plait.telemetry import make_progress
from plait.train import Trainer


@dataclass(frozen=True)
class EvalRows:
    """Every row of a dataset and what the JSON reports about them."""

    rows: Rows
    examples: int  # examples evaluated (text: sequences)
    truncated: int
    dropped: int


def eval_rows(cfg: Config) -> EvalRows:
    """All rows of `cfg.data.path` at `cfg.train.seq_len`: an examples folder packed (or
    padded, `data.pack`) with the `data.long` rule, or text cut into windows; no split."""
    seq = cfg.train.seq_len
    path = cfg.data.path
    if is_examples_dir(path):
        store = ExampleStore(path)
        ids = np.arange(len(store), dtype=np.int64)
        assigned = assign_rows(ids, store.lengths, store.first_target, seq, cfg.data.pack,
                         cfg.data.long)  # fmt: skip
        kept = len(assigned.example)
        return EvalRows(ExampleRows(store, assigned), kept, assigned.truncated, assigned.dropped)
    windows = TokenWindows(load_stream(path, cfg.data.tokenizer, cfg.data.max_bytes), seq)
    return EvalRows(windows, len(windows), 0, 0)


def fit_rows(cfg: Config, made: EvalRows, data: str | None = None) -> None:
    """Every replica needs a row: fewer rows than dp is refused, naming the cause (`data`:
    the path the user gave, where `cfg.data.path` is a prepared copy of it); a micro-batch
    larger than the rows per replica is lowered to them (a small file needs no
    --micro-batch), and the global batch is one micro-batch per replica."""
    rows, dp, seq = len(made.rows), cfg.parallel.layout.dp, cfg.train.seq_len
    name = data or cfg.data.path
    if rows == 0 and isinstance(made.rows, ExampleRows):
        lengths = made.rows.store.lengths
        cause = dropped_reason(lengths, seq, cfg.data.long) or "no example has 2 tokens"
        raise ConfigError(f"data {name!r} gives no rows of seq_len {seq}: {cause}")
    if rows < dp:
        raise ConfigError(
            f"data {name!r} gives {rows} rows of seq_len {seq}, fewer than dp {dp} "
            "replicas; lower --dp"
        )
    cfg.train.micro_batch = min(cfg.train.micro_batch, rows // dp)
    cfg.train.global_batch = cfg.train.micro_batch * dp


PROGRESS_STEPS = 100
"""How many pieces `plait eval` splits its micro-batches into, to show its progress."""


def _totals(trainer: Trainer, batches: list[MicroBatch], show: bool) -> tuple[float, int]:
    """(summed target loss, target tokens) of every replica's `batches`, a piece at a time
    (every replica holds as many micro-batches, so the pieces' exchanges pair up), with a
    progress bar of a replica's micro-batches on rank 0 when `show`."""
    piece = max(1, math.ceil(len(batches) / PROGRESS_STEPS))
    progress = make_progress(Console(stderr=True), len(batches), "eval") if show else None
    loss_sum, targets = 0.0, 0
    if progress:
        task = progress.add_task("eval", total=len(batches), info="micro-batches per replica")
        progress.start()
    try:
        for at in range(0, len(batches), piece):
            chunk = batches[at : at + piece]
            s, n = evaluate_totals(trainer.model, chunk, trainer.comm, trainer.pipeline)
            loss_sum, targets = loss_sum + s, targets + n
            if progress:
                progress.update(task, advance=len(chunk))
    finally:
        if progress:
            progress.stop()
    return loss_sum, targets


def eval_worker(cfg: Config, mesh: Mesh, checkpoint: str | None, result: str) -> dict:
    """One rank's share; rank 0 writes the figures to `result` (a JSON file) and returns them."""
    made = eval_rows(cfg)
    fit_rows(cfg, made)
    trainer = Trainer(cfg, mesh, Corpus(made.rows, made.rows, 0.0))
    try:
        if checkpoint:
            trainer.load_weights(Path(checkpoint))
        per_step = cfg.train.global_batch
        batches = trainer.batches.validation(math.ceil(len(made.rows) / per_step))
        loss_sum, targets = _totals(trainer, batches, mesh.rank == 0 and cfg.log.progress)
    finally:
        trainer.close()
    loss = loss_sum / max(targets, 1)
    figures = {
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else None,  # JSON has no infinity
        "target_tokens": targets,
        "examples": made.examples,
        "rows": len(made.rows),
        "truncated": made.truncated,
        "dropped": made.dropped,
    }
    if mesh.rank == 0:
        Path(result).write_text(json.dumps(figures))
    return figures
