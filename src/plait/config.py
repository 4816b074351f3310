"""Typed configuration: dataclasses whose field help strings are the CLI's help.

A run's config comes from (lowest to highest precedence) the dataclass defaults, a model
preset, a TOML file, and command-line flags. `Config.validate()` checks everything that can
be checked without starting a process (batch arithmetic, divisibility, paths, corpus size)
and raises ConfigError with the offending values.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from plait.composition import (
    check_activation_offload,
    check_context_parallel,
    check_dp_mode,
    check_packed_attention,
    check_partition_activations,
    check_pipeline,
    check_recompute,
    check_reshard,
    check_tensor_parallel,
    check_zero,
)
from plait.data import data_tokenizer, split_windows, stream_length
from plait.data.batches import check_loss_average
from plait.data.examples import check_examples, is_examples_dir
from plait.data.packing import LONG
from plait.data.split import whole_stream
from plait.device import cuda_available, device_kind
from plait.domain import Domain, OrAuto, above, at_least, check_fields, fraction
from plait.errors import ConfigError
from plait.mixed_precision import check_upcast, parse_base_dtype, parse_precision
from plait.models.architecture import ModelConfig
from plait.models.nf4.checks import check_nf4_run
from plait.models.presets import get_preset
from plait.topology import Layout


@dataclass
class ParallelConfig:
    """How the work is split across processes."""

    dp: int = field(
        default=1,
        metadata={
            "domain": OrAuto(int, 1),
            "help": "data-parallel replicas; auto: under torchrun or srun, the world / (tp x pp)",
        },
    )
    pp: int = field(
        default=1, metadata={"domain": at_least(1), "help": "pipeline-parallel stages (ranks)"}
    )
    tp: int = field(
        default=1,
        metadata={"domain": at_least(1), "help": "tensor-parallel ranks (Megatron style)"},
    )
    cp: int = field(
        default=1,
        metadata={
            "domain": at_least(1),
            "help": "context-parallel ranks: each packed document cut into 2 x cp pieces, "
            "rank r holding pieces r and 2cp-1-r; attention exchanges keys and values",
        },
    )
    cp_exchange: str = field(
        default="allgather",
        metadata={
            "help": "context parallel: allgather (each layer's keys and values gathered) or "
            "ring (passed rank to rank, merged by log-sum-exp)"
        },
    )
    sequence_parallel: bool = field(
        default=False, metadata={"help": "tensor parallel: shard norms/dropout by sequence"}
    )
    dp_mode: str = field(
        default="ddp",
        metadata={
            "help": "data parallelism: ddp (bucketed all-reduce overlapped with backward) or "
            "naive (rank 0 scatters inputs, gathers logits, steps alone)"
        },
    )
    schedule: str = field(
        default="1f1b",
        metadata={"help": "pipeline schedule: naive, gpipe, 1f1b, interleaved, zb-h1, 2bw"},
    )
    virtual_stages: int = field(
        default=1,
        metadata={
            "domain": at_least(1),
            "help": "model chunks per pipeline rank (interleaved schedule)",
        },
    )
    microbatches: int = field(
        default=0,
        metadata={
            "domain": at_least(0),
            "help": "micro-batches per step; sets micro-batch = global / (dp x this)",
        },
    )
    stage_layers: str = field(
        default="", metadata={"help": "layers per pipeline stage, e.g. '3,3,2'; default even"}
    )
    bucket_mb: float = field(
        default=25.0, metadata={"domain": above(0), "help": "gradient bucket size in MiB"}
    )
    zero: int = field(
        default=0,
        metadata={
            "domain": Domain(int, 0, 3),
            "help": "ZeRO stage: 0 replicate, 1 optimizer states, 2 +grads, 3 +params",
        },
    )
    precision: str = field(default="fp32", metadata={"help": "fp32, bf16 or fp16 (loss scaling)"})
    reduce_dtype: str | None = field(
        default=None, metadata={"help": "gradient reduction dtype: fp32 or the precision's"}
    )
    base_dtype: str = field(
        default="auto",
        metadata={
            "help": "how a LoRA run holds its frozen base: auto (the precision's parameter "
            "dtype), bf16, fp16, fp32, or nf4 (QLoRA: the blocks' Linear weights in 4-bit "
            "NormalFloat, the rest in the precision's dtype); adapters keep fp32 masters"
        },
    )
    base_upcast: bool = field(
        default=False,
        metadata={
            "help": "QLoRA as PEFT's prepare_model_for_kbit_training: the base's unquantized "
            "weights (embeddings, head, norms), the activations and the adapters in fp32, "
            "only the NF4 products in --precision's dtype (with --base-dtype nf4, bf16/fp16)"
        },
    )
    reshard_after_forward: str = field(
        default="default",
        metadata={
            "help": "ZeRO-3 under a pipeline: default or never (a stage's parameters gathered "
            "once per step, kept through its micro-batches), always (regathered per "
            "micro-batch and block: less memory, m times the all-gathers)"
        },
    )
    offload: str = field(
        default="none", metadata={"help": "optimizer states and master weights: none, cpu, nvme"}
    )
    offload_dir: str | None = field(
        default=None, metadata={"help": "folder for --offload nvme state files"}
    )
    recompute: str = field(
        default="none", metadata={"help": "activation recomputation: none, full or selective"}
    )
    offload_activations: str = field(
        default="none",
        metadata={
            "help": "where the tensors a block saves for backward wait: none (device) or cpu "
            "(host memory; with recompute only the checkpointed block inputs move)"
        },
    )
    partition_activations: bool = field(
        default=False,
        metadata={
            "help": "tensor parallel with recompute: hold each block's saved input 1/tp per "
            "rank and all-gather it in backward (ZeRO-R partitioned activations)"
        },
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
    comm_timeout: float = field(
        default=300.0,
        metadata={"domain": above(0), "help": "seconds before a stalled collective raises"},
    )

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, pp=self.pp, tp=self.tp, cp=self.cp)

    @property
    def two_bw(self) -> bool:
        """The asynchronous PipeDream-2BW stream, rather than a step-by-step schedule."""
        return self.pp > 1 and self.schedule == "2bw"

    def stage_layer_counts(self) -> list[int] | None:
        """`stage_layers` as numbers, or None for an even split."""
        if not self.stage_layers.strip():
            return None
        try:
            return [int(x) for x in self.stage_layers.split(",")]
        except ValueError:
            raise ConfigError(
                f"stage_layers must be comma-separated integers, got {self.stage_layers!r}"
            ) from None


@dataclass
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
    long: str = field(
        default="truncate",
        metadata={
            "help": "instruction data: an example longer than seq_len + 1 tokens is "
            "truncate(d) or drop(ped)"
        },
    )


LR_SCHEDULES = ("cosine", "linear", "constant")
"""`--lr-schedule`: what follows the warmup (optim.lr_at; transformers' schedulers' names)."""


@dataclass
class TrainConfig:
    """The optimization loop."""

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
    lr: float = field(default=3e-3, metadata={"domain": above(0), "help": "peak learning rate"})
    lr_schedule: str = field(
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
    loss_average: str = field(
        default="tokens",
        metadata={
            "help": "tokens: summed target losses / the global batch's target count (exact); "
            "micro-batch: each micro-batch's own mean, averaged (transformers before PR "
            "#34191; for comparison)"
        },
    )
    grad_clip: float = field(
        default=1.0,
        metadata={"domain": at_least(0, float), "help": "global gradient-norm clip; 0 = off"},
    )
    eval_every: int = field(
        default=50,
        metadata={"domain": at_least(0), "help": "validate every N steps; 0 = only last"},
    )
    eval_batches: int = field(
        default=4, metadata={"domain": at_least(1), "help": "global batches per validation"}
    )
    keep_best: bool = field(
        default=False,
        metadata={
            "help": "checkpoint each validation that improves the loss and keep the best "
            "(OUT/checkpoints/best.json names it; pruning spares it)"
        },
    )
    seed: int = field(
        default=0,
        metadata={"domain": at_least(0), "help": "seed for weights, data order and dropout"},
    )
    out: str = field(default="runs/default", metadata={"help": "output folder"})
    overwrite: bool = field(
        default=False, metadata={"help": "replace the run already in the output folder"}
    )
    tensorboard: bool = field(default=False, metadata={"help": "also log to TensorBoard"})
    save_every: int = field(
        default=0,
        metadata={
            "domain": at_least(0),
            "help": "write a checkpoint every N steps; 0 = only at the end",
        },
    )
    save: bool = field(
        default=True, metadata={"help": "write a checkpoint at the end (--no-save: none at all)"}
    )
    keep_checkpoints: int = field(
        default=3, metadata={"domain": at_least(1), "help": "keep the newest N checkpoints"}
    )
    max_restarts: int = field(
        default=0,
        metadata={
            "domain": at_least(0),
            "help": "restart the world from the newest checkpoint on a failure",
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
    adapter: str = field(
        default="",
        metadata={
            "help": "with --init-from: start from a PEFT LoRA adapter folder (its rank, alpha, "
            "dropout, targets and weights)"
        },
    )
    peak_flops: float = field(
        default=0.0,
        metadata={
            "domain": at_least(0, float),
            "help": "peak FLOP/s per device for MFU; 0 = known GPUs only",
        },
    )
    nan_policy: str = field(
        default="stop",
        metadata={
            "help": "a NaN/inf loss or gradient norm: stop (exit 1, the last checkpoint kept) "
            "or skip the step (counted in the summary); fp16's scaler skips overflows itself"
        },
    )
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar on rank 0"})
    trace: bool = field(
        default=False,
        metadata={"help": "pipeline: write a Chrome trace and Gantt chart of the last step"},
    )


@dataclass
class Config:
    """Everything a run needs; `model` is resolved from `preset` plus overrides."""

    preset: str = "small-gpt"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def accumulation(self) -> int:
        return self.train.global_batch // (self.train.micro_batch * self.parallel.dp)

    def validate(self, check_data: bool = True) -> None:
        validate_config(self, check_data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "train": TrainConfig,
}


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def build_config(
    preset: str, overrides: dict[str, dict[str, Any]], model: ModelConfig | None = None
) -> Config:
    """Preset model (or `model`, e.g. a Hugging Face folder's) + per-section overrides ->
    Config; unknown keys are errors."""
    cfg = Config(preset=preset, model=model or get_preset(preset))
    for section, values in overrides.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section [{section}]; known: {', '.join(SECTIONS)}")
        target = getattr(cfg, section)
        names = {f.name for f in dataclasses.fields(target)}
        for key, value in values.items():
            if key not in names:
                raise ConfigError(
                    f"unknown key {key!r} in [{section}]; known: {', '.join(sorted(names))}"
                )
            setattr(target, key, value)
    _derive_micro_batch(cfg)
    explicit = overrides.get("model", {}).get("vocab_size")
    follow_tokenizer(cfg, model.vocab_size if model else explicit, model is not None)
    return cfg


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


def _derive_micro_batch(cfg: Config) -> None:
    """--microbatches M fixes the micro-batch size: global batch / (dp x M)."""
    m, dp, g = cfg.parallel.microbatches, cfg.parallel.dp, cfg.train.global_batch
    if not isinstance(m, int) or isinstance(m, bool) or m == 0:
        return  # unset (or a wrong type, which check_types names)
    if m < 0:
        raise ConfigError(f"microbatches must be >= 1 (0 = from --micro-batch), got {m}")
    if not isinstance(dp, int) or not isinstance(g, int) or dp < 1 or g % (dp * m):
        raise ConfigError(
            f"global batch {g} is not divisible by dp {dp} x microbatches {m} = {dp * m}"
        )
    cfg.train.micro_batch = g // (dp * m)


def _type_ok(annotation: str, value: Any) -> bool:
    if value is None:
        return "None" in annotation
    if "bool" in annotation:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if "int" in annotation:
        return isinstance(value, int)
    if "float" in annotation:
        return isinstance(value, int | float)
    return isinstance(value, str)


def check_types(cfg: Config) -> None:
    """A TOML string where a number belongs must fail here, not deep inside a worker."""
    for section in SECTIONS:
        target = getattr(cfg, section)
        for f in dataclasses.fields(target):
            value = getattr(target, f.name)
            if not _type_ok(str(f.type), value):
                raise ConfigError(
                    f"{section}.{f.name} must be {f.type}, got {value!r} ({type(value).__name__})"
                )


def _check_base_dtype(
    par: ParallelConfig, model: ModelConfig, lora: bool, init_from: str = ""
) -> None:
    """`--base-dtype` names a dtype, needs `--lora-rank`, and is honoured by the engine that
    runs: the ZeRO engine holds the frozen base in it (parallel/zero/frozen.py); naive data
    parallelism and 2BW keep every parameter in the precision's dtype. A folder saved 4-bit
    is read only as an NF4 base."""
    base = parse_base_dtype(par.base_dtype, par.precision, lora)
    changed = base != parse_precision(par.precision).param_dtype or par.base_dtype == "nf4"
    if changed and (par.dp_mode == "naive" or par.two_bw):
        engine = "--dp-mode naive" if par.dp_mode == "naive" else "--schedule 2bw"
        raise ConfigError(
            f"--base-dtype {par.base_dtype} is held by the ZeRO engine only; {engine} keeps "
            f"the base in the precision's dtype ({par.precision}): give --base-dtype auto"
        )
    check_nf4_run(par.base_dtype, par.tp, model, init_from)
    if par.base_upcast:
        check_upcast(par.base_dtype, par.precision, par.reduce_dtype)


def validate_config(cfg: Config, check_data: bool = True) -> None:
    """Everything checkable before workers start; the first problem found is raised."""
    check_types(cfg)
    cfg.model.validate()  # the model's problems first (its domains included)
    for section in ("parallel", "data", "train"):
        check_fields(section, getattr(cfg, section))
    t, par = cfg.train, cfg.parallel
    layout = par.layout
    per_step = t.micro_batch * layout.dp
    if t.global_batch % per_step:
        raise ConfigError(
            f"global batch {t.global_batch} is not a multiple of micro-batch {t.micro_batch} "
            f"x dp {layout.dp} = {per_step} (global batch = micro-batch x accumulation x dp)"
        )
    cfg.model.check_seq_len(t.seq_len)
    check_recompute(par.recompute)
    check_activation_offload(par.offload_activations)
    if t.min_lr > t.lr:
        raise ConfigError(f"need min_lr <= lr; got lr={t.lr}, min_lr={t.min_lr}")
    _check_run_length(t)
    check_pipeline(
        cfg.model.n_layers,
        par.pp,
        par.schedule,
        par.virtual_stages,
        cfg.accumulation,
        par.stage_layer_counts(),
    )
    check_tensor_parallel(cfg.model, par.tp, par.sequence_parallel, t.seq_len)
    check_partition_activations(par.partition_activations, par.tp, par.recompute,
                                par.sequence_parallel, par.two_bw)  # fmt: skip
    check_context_parallel(par.cp, par.cp_exchange, t.seq_len, par.tp, par.sequence_parallel,
                           par.pp, par.schedule, par.dp_mode, cfg.model)  # fmt: skip
    check_dp_mode(par.dp_mode, par.tp, par.pp, par.zero, par.precision, par.offload)
    check_zero(
        par.zero,
        par.offload,
        par.offload_dir,
        par.pp,
        par.precision,
        par.reduce_dtype,
        par.schedule,
    )
    check_reshard(par.reshard_after_forward, par.zero, par.pp)
    check_packed_attention(par.packed_attention, device_kind(t.device), par.precision,
                           cfg.model.dropout)  # fmt: skip
    _check_base_dtype(par, cfg.model, cfg.model.lora is not None, t.init_from)
    check_loss_average(t.loss_average)
    if t.nan_policy not in ("stop", "skip"):
        raise ConfigError(f"nan_policy must be stop or skip; got {t.nan_policy!r}")
    if t.nan_policy == "skip" and par.two_bw:  # its weight versions advance every step
        raise ConfigError("--nan-policy skip does not combine with --schedule 2bw; use stop")
    if t.tensorboard and find_spec("tensorboard") is None:  # rank 0 would fail importing it
        raise ConfigError(
            "--tensorboard needs the tensorboard package: pip install 'plait[tensorboard]'"
        )
    if cfg.data.long not in LONG:
        raise ConfigError(f"long must be one of {', '.join(LONG)}; got {cfg.data.long!r}")
    if t.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu or cuda; got {t.device!r}")
    if t.device == "cuda" and not cuda_available():
        raise ConfigError("device 'cuda' was asked for, but this torch sees no CUDA device")
    if cfg.data.tokenizer_hash is None and cfg.model.vocab_size < 256:
        raise ConfigError(
            f"model.vocab_size {cfg.model.vocab_size} is smaller than the byte tokenizer's 256"
        )
    if check_data:
        derive_steps(t, _validate_corpus(cfg))


def _check_run_length(t: TrainConfig) -> None:
    """The schedule's name, and --keep-best's needs: checkpoints, and validations to pick
    from (with --eval-every 0 the last step's alone, which the last checkpoint already is)."""
    if t.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(
            f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}; got {t.lr_schedule!r}"
        )
    if t.keep_best and not t.save:
        raise ConfigError("--keep-best keeps a checkpoint, but --no-save writes none; drop one")
    if t.keep_best and not t.eval_every:
        raise ConfigError(
            "--keep-best picks among validations, but --eval-every 0 validates only the last "
            "step; give --eval-every N"
        )


def derive_steps(t: TrainConfig, train_rows: int) -> None:
    """--epochs N: steps = N x the full global batches in the training rows (the sampler's
    epoch: a remainder smaller than a batch is dropped); --warmup-ratio: warmup_steps =
    ceil(ratio x steps), as transformers rounds it. Idempotent (a run validated twice)."""
    if t.epochs:
        t.steps = t.epochs * (train_rows // t.global_batch)
    if t.warmup_ratio:
        t.warmup_steps = math.ceil(t.warmup_ratio * t.steps)


def config_warnings(cfg: Config) -> list[str]:
    """What a valid config may still get wrong, for the user to judge (one line each).

    RoPE computes any position, so a seq_len past max_seq_len runs, as it does in
    transformers (whose Llama takes inputs past max_position_embeddings without a word); a
    warning rather than a refusal, because extending the context is a legitimate choice,
    but the model was (pre)trained on shorter sequences and an export keeps the old limit."""
    out = []
    m, t = cfg.model, cfg.train
    if m.pos == "rope" and t.seq_len > m.max_seq_len:
        out.append(
            f"seq_len {t.seq_len} is longer than the model's max_seq_len {m.max_seq_len} "
            "(max_position_embeddings): RoPE runs past it, but positions beyond it are "
            f"untrained, and an export still says {m.max_seq_len}"
        )
    if cfg.parallel.precision == "fp16" and device_kind(t.device) == "cpu":
        out.append(
            "fp16 on a CPU runs about 10x slower than fp32 (torch's CPU fp16 matmul); "
            "--precision bf16 is fast here"
        )
    return out


def _validate_corpus(cfg: Config) -> int:
    """The data gives one global batch of training rows and a validation; returns the
    training rows (what --epochs counts)."""
    t, d = cfg.train, cfg.data
    if d.eval_data is not None:
        _check_eval_data(d)
    if is_examples_dir(d.path):  # rows from the index alone: no token is read here
        train, _ = check_examples(d.path, t.seq_len, d.val_fraction, d.pack, d.long,
                                  t.global_batch, t.init_from, d.eval_data)  # fmt: skip
        return train
    available = stream_length(cfg.data.path, cfg.data.tokenizer, cfg.data.max_bytes)
    source = cfg.data.path or "the default corpus"
    unit = "bytes" if cfg.data.tokenizer_hash is None else "tokens"
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


def _check_eval_data(d: DataConfig) -> None:
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
