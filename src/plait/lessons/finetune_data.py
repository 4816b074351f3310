"""The finetune lesson's data: an instruction set built offline, and what its rows hold.

The examples are the offline instruction set of `plait data instructions` (documented
standard-library functions as Alpaca records: the docstring the instruction, the source the
response), capped with evenly spaced picks and held to Alpaca-like lengths (a few dozen to a
few hundred tokens), tokenized with a small byte-level BPE trained on the records and
prepared as `plait data prepare --format alpaca` prepares them: the same library functions,
called in process, into the lesson's temporary folder.

The rest reads the rows a case trained on, replaying the seeded sampler as every rank does
(`data/batches.py`): each micro-batch's target count (what the per-micro-batch mean weighs
by), each step's target tokens, and the padding the drawn rows really hold.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from plait.config import Config
from plait.data.examples import ExampleRows, example_corpus
from plait.data.instruct import InstructJob, prepare_examples
from plait.data.sampler import GlobalBatchSampler, replica_share, split_micro
from plait.data.stdlib_instructions import Limits, build, write_jsonl
from plait.data.tokenizer import train_bpe

LIMITS = Limits(max_doc_chars=400, max_output_lines=25, max_output_chars=700,
                max_record_chars=1000)  # fmt: skip
"""Shorter than `plait data instructions`' defaults: ~60-300 tokens an example, Alpaca's."""


def build_examples(folder: Path, examples: int, vocab: int) -> Path:
    """`examples` stdlib instruction records, a `vocab`-token BPE trained on them, and the
    examples folder prepared from both, all under `folder`; returns the examples folder."""
    folder.mkdir(parents=True, exist_ok=True)
    records, _ = build(max_examples=examples, limits=LIMITS)
    write_jsonl(records, folder / "instructions.jsonl")
    texts = [f"{r['instruction']}\n{r['input']}\n{r['output']}" for r in records]
    train_bpe(texts, vocab, folder / "tokenizer.json", len(texts), progress=False)
    out = folder / "examples"
    job = InstructJob(str(folder / "instructions.jsonl"), out, "alpaca",
                      str(folder / "tokenizer.json"))  # fmt: skip
    prepare_examples(job)
    return out


def training_rows(cfg: Config) -> tuple[ExampleRows, ExampleRows]:
    """The (training, validation) rows `cfg`'s run trained on, built as every rank built them."""
    d = cfg.data
    made = example_corpus(d.path, cfg.train.seq_len, d.val_fraction, d.pack, d.long)
    return made.train, made.val


def step_indices(cfg: Config, rows: ExampleRows) -> list[torch.Tensor]:
    """Each step's global batch of row indices, as the seeded sampler drew them."""
    t = cfg.train
    sampler = GlobalBatchSampler(len(rows), t.global_batch, t.seed)
    return [sampler.next_batch() for _ in range(t.steps)]


def micro_counts(cfg: Config, rows: ExampleRows, idx: torch.Tensor) -> list[int]:
    """Target tokens of every micro-batch of one step, replica after replica."""
    dp, micro = cfg.parallel.dp, cfg.train.micro_batch
    return [rows.target_count(m) for r in range(dp)
            for m in split_micro(replica_share(idx, r, dp)[0], micro)]  # fmt: skip


def padding_share(rows: ExampleRows) -> float:
    """The share of row positions that hold no example token, read from every row's
    segments as drawn (the padding is the last run of a row whose examples do not fill it)."""
    pad = 0
    for chunk in torch.arange(len(rows)).split(256):
        _, _, seg = rows.draw(chunk)
        examples = np.diff(rows.assigned.row_start)[chunk.numpy()]  # a row's example runs
        pad += int((seg.numpy() == examples[:, None]).sum())
    return pad / (len(rows) * rows.seq_len)


def packed_rows_bound(rows: ExampleRows) -> int:
    """The fewest rows the examples could fill: their positions / seq_len, rounded up."""
    return -(-int(rows.assigned.positions.sum()) // rows.seq_len)
