"""The corpus a run reads, measured before any worker starts: it must give one global batch
of training rows and a validation, and `--epochs` counts its rows."""

from __future__ import annotations

import math
from pathlib import Path

from plait.config import Config, DataConfig, OptimConfig, TrainConfig
from plait.data import data_tokenizer, split_windows, stream_length
from plait.data.examples import check_examples, is_examples_dir
from plait.data.split import whole_stream
from plait.errors import ConfigError


def measure_corpus(cfg: Config) -> int:
    """The data gives one global batch of training rows and a validation; returns the
    training rows (what --epochs counts)."""
    t, d = cfg.train, cfg.data
    if d.eval_data is not None:
        check_eval_data(d)
    if is_examples_dir(d.path):  # rows from the index alone: no token is read here
        train, _ = check_examples(d.path, t.seq_len, d.val_fraction, d.pack, d.long,
                                  t.global_batch, cfg.checkpoint.init_from,
                                  d.eval_data)  # fmt: skip
        return train
    available = stream_length(d.path, d.tokenizer, d.max_bytes)
    source = d.path or "the default corpus"
    unit = "bytes" if d.tokenizer_hash is None else "tokens"
    if available == 0:
        raise ConfigError(f"corpus {source!r} holds no text (empty and binary files are skipped)")
    if d.eval_data is not None:
        train_windows = whole_stream(available, t.seq_len).windows
        held = stream_length(d.eval_data, d.tokenizer, d.max_bytes)
        val_windows = whole_stream(held, t.seq_len).windows
    else:
        split = split_windows(available, t.seq_len, d.val_fraction)  # the split a run makes
        train_windows, val_windows = split.train.windows, split.val.windows
    if train_windows < t.global_batch or val_windows < 1:
        where = f" (--eval-data {d.eval_data})" if d.eval_data is not None else ""
        raise ConfigError(
            f"corpus {source!r} has {available} {unit}: {train_windows} training and "
            f"{val_windows} validation sequences{where} of seq_len {t.seq_len}, but one global "
            f"batch needs {t.global_batch} training sequences and validation at least 1"
        )
    return train_windows


def check_eval_data(d: DataConfig) -> None:
    """--eval-data is prepared as --data is: both examples folders or both text, and the
    same tokenizer (its losses must be in the model's tokens)."""
    if not Path(d.eval_data).exists():
        raise ConfigError(f"--eval-data {d.eval_data} does not exist")
    if is_examples_dir(d.path) != is_examples_dir(d.eval_data):
        kinds = {True: "an examples folder (data prepare --format alpaca|chat)", False: "text"}
        raise ConfigError(
            f"--eval-data {d.eval_data} is {kinds[is_examples_dir(d.eval_data)]}, but --data "
            f"{d.path} is {kinds[is_examples_dir(d.path)]}; prepare both the same way"
        )
    ours = data_tokenizer(d.path, d.tokenizer)
    theirs = data_tokenizer(d.eval_data, d.tokenizer)
    if ours.identity != theirs.identity:
        raise ConfigError(
            f"--eval-data {d.eval_data} was made with tokenizer {theirs.name}, --data "
            f"{d.path} with {ours.name}; prepare both with the same --tokenizer"
        )


def derive_steps(t: TrainConfig, o: OptimConfig, train_rows: int) -> None:
    """--epochs N: steps = N x the full global batches in the training rows (the sampler's
    epoch: a remainder smaller than a batch is dropped); --warmup-ratio: warmup_steps =
    ceil(ratio x steps), as transformers rounds it. Idempotent (a run validated twice)."""
    if t.epochs:
        t.steps = t.epochs * (train_rows // t.global_batch)
    if o.warmup_ratio:
        o.warmup_steps = math.ceil(o.warmup_ratio * t.steps)
