"""The sections of a run's configuration that say what the loop does: [data] (where the
text comes from), [train] (the batch, the loss, the length and the device of the run),
[optim] (AdamW and its learning-rate schedule), [checkpoint] (what is saved, resumed or
started from) and [log] (where the run writes and what it reports).

A `Literal` annotation lists a field's choices: `plait.config.types` checks them, the one
place that reads annotations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from plait.domain import above, at_least, fraction


@dataclass(slots=True)
class DataConfig:
    """Where the text comes from."""

    path: str | None = field(
        default=None,
        metadata={
            "help": "text file or folder; default: this Python's standard library sources",
            "flag": "--data",
            "once": True,  # a second --data is refused, not silently kept instead
        },
    )
    max_bytes: int = field(
        default=8_000_000, metadata={"domain": at_least(1), "help": "read at most this many bytes"}
    )
    val_fraction: float = field(
        default=0.05,
        metadata={
            "domain": fraction(low_open=True),
            "help": "share held out for validation, evenly spaced through the data",
        },
    )
    eval_data: str | None = field(
        default=None,
        metadata={
            "help": "a separate validation set, prepared as --data is (an examples folder, "
            "shards or text, the same tokenizer); then --data trains whole, nothing held out"
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "tokenizer.json or Hugging Face tokenizer folder; default: bytes"},
    )
    tokenizer_hash: str | None = field(
        default=None,
        metadata={"help": "SHA-256 of the tokenizer (bytes: none); derived", "derived": True},
    )
    pack: bool = field(
        default=True,
        metadata={
            "help": "instruction data: pack examples into rows (best-fit decreasing, "
            "block-causal); --no-pack: one example a row, padded"
        },
    )
    long: Literal["truncate", "drop"] = field(
        default="truncate",
        metadata={
            "help": "instruction data: an example longer than seq_len + 1 tokens is "
            "truncate(d) or drop(ped)"
        },
    )


@dataclass(slots=True)
class TrainConfig:
    """The run: its length, batch, loss, precision, device and what a bad step does."""

    steps: int = field(
        default=600,
        metadata={"domain": at_least(1), "help": "optimizer steps (or derived from --epochs)"},
    )
    epochs: int = field(
        default=0,
        metadata={
            "domain": at_least(0),
            "help": "passes over the training rows: steps = epochs x (rows // global batch), "
            "printed before training; 0 = --steps",
        },
    )
    micro_batch: int = field(
        default=8, metadata={"domain": at_least(1), "help": "sequences per micro-batch per rank"}
    )
    global_batch: int = field(
        default=16,
        metadata={
            "domain": at_least(1),
            "help": "sequences per step = micro-batch x accumulation x dp",
        },
    )
    seq_len: int = field(
        default=128, metadata={"domain": at_least(1), "help": "tokens per sequence"}
    )
    loss_average: Literal["tokens", "micro-batch"] = field(
        default="tokens",
        metadata={
            "help": "tokens: summed target losses / the global batch's target count (exact); "
            "micro-batch: each micro-batch's own mean, averaged (transformers before PR "
            "#34191; for comparison)"
        },
    )
    eval_every: int = field(
        default=50,
        metadata={"domain": at_least(0), "help": "validate every N steps; 0 = only last"},
    )
    eval_batches: int = field(
        default=4, metadata={"domain": at_least(1), "help": "global batches per validation"}
    )
    seed: int = field(
        default=0,
        metadata={"domain": at_least(0), "help": "seed for weights, data order and dropout"},
    )
    precision: str = field(default="fp32", metadata={"help": "fp32, bf16 or fp16 (loss scaling)"})
    reduce_dtype: str | None = field(
        default=None, metadata={"help": "gradient reduction dtype: fp32 or the precision's"}
    )
    packed_attention: str = field(
        default="auto",
        metadata={
            "help": "packed rows' attention: auto (per-document on CPU; on CUDA varlen in 16-bit, "
            "else mask), mask "
            "(dense block-causal, the reference), per-document (causal SDPA per example), "
            "varlen (torch's varlen_attn: CUDA, bf16/fp16)"
        },
    )
    device: Literal["auto", "cpu", "cuda"] = field(
        default="auto", metadata={"help": "auto, cpu or cuda"}
    )
    nan_policy: Literal["stop", "skip"] = field(
        default="stop",
        metadata={
            "help": "a NaN/inf loss or gradient norm: stop (exit 1, the last checkpoint kept) "
            "or skip the step (counted in the summary); fp16's scaler skips overflows itself"
        },
    )
    max_restarts: int = field(
        default=0,
        metadata={
            "domain": at_least(0),
            "help": "restart the world from the newest checkpoint on a failure",
        },
    )


LRSchedule = Literal["cosine", "linear", "constant"]
LR_SCHEDULES = get_args(LRSchedule)
"""`--lr-schedule`: what follows the warmup (optim.lr_at; transformers' schedulers' names)."""


@dataclass(slots=True)
class OptimConfig:
    """AdamW, its learning-rate schedule and the gradient clip (torchtitan's [optimizer]
    and [lr_scheduler])."""

    lr: float = field(default=3e-3, metadata={"domain": above(0), "help": "peak learning rate"})
    lr_schedule: LRSchedule = field(
        default="cosine",
        metadata={"help": "after the warmup: cosine or linear decay to --min-lr, or constant (lr)"},
    )
    min_lr: float = field(
        default=3e-4,
        metadata={
            "domain": at_least(0, float),
            "help": "learning rate at the end of the cosine or linear decay",
        },
    )
    warmup_steps: int = field(
        default=30, metadata={"domain": at_least(0), "help": "linear warmup steps"}
    )
    warmup_ratio: float = field(
        default=0.0,
        metadata={
            "domain": fraction(),
            "help": "warmup as a share of the steps: warmup_steps = ceil(ratio x steps), as "
            "transformers rounds; 0 = --warmup-steps",
        },
    )
    weight_decay: float = field(
        default=0.1, metadata={"domain": at_least(0, float), "help": "AdamW decay (matrices only)"}
    )
    beta1: float = field(default=0.9, metadata={"domain": fraction(), "help": "AdamW beta1"})
    beta2: float = field(default=0.95, metadata={"domain": fraction(), "help": "AdamW beta2"})
    grad_clip: float = field(
        default=1.0,
        metadata={"domain": at_least(0, float), "help": "global gradient-norm clip; 0 = off"},
    )


@dataclass(slots=True)
class CheckpointConfig:
    """What is saved, what a run resumes, and the weights it starts from (torchtitan's
    [checkpoint], whose initial_load_path is --init-from)."""

    save: bool = field(
        default=True, metadata={"help": "write a checkpoint at the end (--no-save: none at all)"}
    )
    save_every: int = field(
        default=0,
        metadata={
            "domain": at_least(0),
            "help": "write a checkpoint every N steps; 0 = only at the end",
        },
    )
    keep_checkpoints: int = field(
        default=3, metadata={"domain": at_least(1), "help": "keep the newest N checkpoints"}
    )
    keep_best: bool = field(
        default=False,
        metadata={
            "help": "checkpoint each validation that improves the loss and keep the best "
            "(OUT/checkpoints/best.json names it; pruning spares it)"
        },
    )
    resume: str = field(
        default="",
        metadata={"help": "continue from 'latest' (in --out), a checkpoint folder, or a run's OUT"},
    )
    init_from: str = field(
        default="",
        metadata={"help": "start from a Hugging Face Llama/GPT-2 folder (its config and weights)"},
    )
    init_from_sha256: str | None = field(
        default=None,
        metadata={
            "help": "SHA-256 of --init-from's config and weights, a LoRA run's base "
            "(checkpoint/base.py); derived",
            "derived": True,
        },
    )


@dataclass(slots=True)
class LogConfig:
    """Where the run writes, and what it reports while it runs."""

    out: str = field(default="runs/default", metadata={"help": "output folder"})
    overwrite: bool = field(
        default=False, metadata={"help": "replace the run already in the output folder"}
    )
    tensorboard: bool = field(default=False, metadata={"help": "also log to TensorBoard"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar on rank 0"})
    trace: bool = field(
        default=False,
        metadata={"help": "pipeline: write a Chrome trace and Gantt chart of the last step"},
    )
    peak_flops: float = field(
        default=0.0,
        metadata={
            "domain": at_least(0, float),
            "help": "peak FLOP/s per device for MFU; 0 = known GPUs only",
        },
    )
