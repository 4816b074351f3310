"""The run summary's text sample: a short greedy continuation by the trained model.

Read back whole from the run's last checkpoint by rank 0 alone (any layout, no collective, so
no other rank waits), then decoded with `models/generate.py`. The prompt is the validation
text's start, or for an instruction run the first validation example's prompt, which the
examples store gives (`data/examples.py` `first_val_prompt`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from plait.checkpoint import inspect
from plait.config import Config
from plait.data.batches import Corpus
from plait.data.examples import first_val_prompt, is_examples_dir
from plait.data.stream import data_tokenizer
from plait.data.tokenizer import text_tokenizer
from plait.models.generate import complete, stop_ids
from plait.models.transformer import Transformer

SAMPLE_PROMPT, SAMPLE_TOKENS = 16, 48
SAMPLE_MAX_PARAMS = 150_000_000  # above: reading it whole on one CPU is no longer cheap


def sample(checkpoint: Path, corpus: Corpus, cfg: Config) -> dict[str, str]:
    """A short greedy continuation of the validation text's start by the trained model (an
    instruction run: `instruct_sample`), read back whole from its last checkpoint."""
    model = inspect.load_model(checkpoint)
    if is_examples_dir(cfg.data.path):
        return instruct_sample(model, cfg)
    tokenizer = text_tokenizer(data_tokenizer(cfg.data.path, cfg.data.tokenizer))
    first = corpus.val.draw(torch.zeros(1, dtype=torch.int64))[0]  # any Rows: tokens first
    prompt = tokenizer.decode(first[0, :SAMPLE_PROMPT])
    room = model.cfg.max_seq_len - len(tokenizer.encode(prompt))
    n = min(SAMPLE_TOKENS, room) if model.cfg.pos == "learned" else SAMPLE_TOKENS
    return {"prompt": prompt, "text": complete(model, tokenizer, prompt, n)}


def instruct_sample(model: Transformer, cfg: Config) -> dict[str, str]:
    """An instruction run's sample: the model's greedy answer to the first validation
    example's prompt (a fixed instruction, the same for every run on these examples),
    stopping at `stop_ids` (the --init-from folder's, else EOS)."""
    ids, pad = first_val_prompt(cfg.data.path, cfg.data.val_fraction)
    tokenizer = text_tokenizer(data_tokenizer(cfg.data.path, cfg.data.tokenizer))
    n = SAMPLE_TOKENS
    if model.cfg.pos == "learned":
        n = min(n, model.cfg.max_seq_len - len(ids))
        if n < 1:
            return {"prompt": tokenizer.decode(ids), "text": ""}
    stop = stop_ids(pad, cfg.checkpoint.init_from or None)
    return {"prompt": tokenizer.decode(ids), "text": complete(model, tokenizer, ids, n, stop=stop)}
