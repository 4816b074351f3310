"""The pre-launch checks that read files: what a run's config needs from its data and its
model folders, settled before any worker starts (each problem one line, exit 2).

  __init__.py  `configure` (a config built and its tokenizer followed), `check_run` (the
               config's checks, then the corpus), `follow_tokenizer`
  corpus.py    measuring the corpus, `--eval-data`'s agreement with `--data`, `--epochs`
  folders.py   `--init-from`'s Hugging Face folder and `--adapter`'s PEFT folder into a config

The configuration itself (`plait.config`) reads no file, so the engines under parallel/
import it without the data package; nothing under parallel/ imports this package
(tests/test_layering.py).
"""

from __future__ import annotations

from typing import Any

from plait.config import Config, build_config, validate_config
from plait.data import data_tokenizer
from plait.errors import ConfigError
from plait.models.architecture import ModelConfig
from plait.preflight.corpus import derive_steps, measure_corpus

__all__ = ["check_run", "configure", "derive_steps", "follow_tokenizer", "measure_corpus"]


def configure(
    preset: str, overrides: dict[str, dict[str, Any]], model: ModelConfig | None = None
) -> Config:
    """A run's config as the command builds it: `build_config`, then the model's vocabulary
    following the data's tokenizer (`follow_tokenizer`; an explicit or a folder's
    vocab_size is checked against it)."""
    cfg = build_config(preset, overrides, model)
    explicit = overrides.get("model", {}).get("vocab_size")
    follow_tokenizer(cfg, model.vocab_size if model else explicit, model is not None)
    return cfg


def check_run(cfg: Config, check_data: bool = True) -> None:
    """Everything checkable before workers start: the config's own checks, then (unless
    `check_data` is False: the estimator needs only shapes) the corpus, which also turns
    --epochs into steps."""
    validate_config(cfg)
    if check_data:
        derive_steps(cfg.train, cfg.optim, measure_corpus(cfg))


def follow_tokenizer(cfg: Config, explicit_vocab: int | None, from_folder: bool = False) -> None:
    """The model's vocabulary follows a tokenizer (given, or the one the shards were made
    with); the byte tokenizer keeps the preset's. An explicit, different vocab_size is an
    error naming both. An --init-from folder's embedding may have more rows than its
    tokenizer has tokens (Hugging Face models often pad it) but never fewer: it is kept.
    The tokenizer's hash goes into the config, so a resumed run checks it."""
    spec = data_tokenizer(cfg.data.path, cfg.data.tokenizer)
    cfg.data.tokenizer_hash = spec.identity
    if spec.identity is None:
        return
    if from_folder and explicit_vocab is not None:
        if spec.vocab_size > explicit_vocab:
            raise ConfigError(
                f"tokenizer {spec.name} has {spec.vocab_size} tokens, more than the "
                f"--init-from folder's vocab_size {explicit_vocab} (its embedding rows); give "
                "the tokenizer the model was trained with"
            )
        return
    if explicit_vocab is not None and explicit_vocab != spec.vocab_size:
        raise ConfigError(
            f"model.vocab_size {explicit_vocab} does not match the vocabulary of tokenizer "
            f"{spec.name}, {spec.vocab_size}; leave --vocab-size out to follow the tokenizer"
        )
    cfg.model.vocab_size = spec.vocab_size
