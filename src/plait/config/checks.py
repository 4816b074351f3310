"""The checks of a run's configuration, one function per section (and one for what spans
sections), run by `validate_config` before any worker starts; each raises ConfigError naming
the values. Nothing here reads a file (the corpus is `plait.preflight`'s).

The order is the order problems are reported in: types first (a TOML string where a number
belongs), then the model, then each section's own fields, then what combines across them.
"""

from __future__ import annotations

import dataclasses
from importlib.util import find_spec

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
from plait.config.layout_sections import MODEL_LORA, LoRAConfig, MemoryConfig, ParallelConfig
from plait.config.loop_sections import (
    CheckpointConfig,
    DataConfig,
    LogConfig,
    OptimConfig,
    TrainConfig,
)
from plait.device import cuda_available, device_kind
from plait.errors import ConfigError
from plait.mixed_precision import check_upcast, parse_base_dtype, parse_precision
from plait.models.architecture import ModelConfig
from plait.models.nf4.checks import check_nf4_run


def check_train(t: TrainConfig, par: ParallelConfig, model: ModelConfig) -> None:
    """The batch arithmetic, the sequence length, the device and the bad-step policy."""
    per_step = t.micro_batch * par.layout.dp
    if t.global_batch % per_step:
        raise ConfigError(
            f"global batch {t.global_batch} is not a multiple of micro-batch {t.micro_batch} "
            f"x dp {par.layout.dp} = {per_step} (global batch = micro-batch x accumulation x dp)"
        )
    model.check_seq_len(t.seq_len)
    if t.nan_policy == "skip" and par.two_bw:  # its weight versions advance every step
        raise ConfigError("--nan-policy skip does not combine with --schedule 2bw; use stop")
    if t.device == "cuda" and not cuda_available():
        raise ConfigError("device 'cuda' was asked for, but this torch sees no CUDA device")
    check_packed_attention(t.packed_attention, device_kind(t.device), t.precision,
                           model.dropout)  # fmt: skip


def check_optim(o: OptimConfig) -> None:
    if o.min_lr > o.lr:
        raise ConfigError(f"need min_lr <= lr; got lr={o.lr}, min_lr={o.min_lr}")


def check_checkpoint(c: CheckpointConfig, t: TrainConfig) -> None:
    """--keep-best's needs: checkpoints, and validations to pick from (with --eval-every 0
    the last step's alone, which the last checkpoint already is)."""
    if c.keep_best and not c.save:
        raise ConfigError("--keep-best keeps a checkpoint, but --no-save writes none; drop one")
    if c.keep_best and not t.eval_every:
        raise ConfigError(
            "--keep-best picks among validations, but --eval-every 0 validates only the last "
            "step; give --eval-every N"
        )


def check_log(log: LogConfig) -> None:
    if log.tensorboard and find_spec("tensorboard") is None:  # rank 0 would fail importing it
        raise ConfigError(
            "--tensorboard needs the tensorboard package: pip install 'plait[tensorboard]'"
        )


def check_parallel(
    par: ParallelConfig, mem: MemoryConfig, t: TrainConfig, model: ModelConfig, accumulation: int
) -> None:
    """The layout: pipeline stages and schedule, tensor parallelism, the data-parallel mode."""
    check_pipeline(model.n_layers, par.pp, par.schedule, par.virtual_stages, accumulation,
                   par.stage_layer_counts())  # fmt: skip
    check_tensor_parallel(model, par.tp, par.sequence_parallel, t.seq_len)
    check_context_parallel(par.cp, par.cp_exchange, t.seq_len, par.tp, par.sequence_parallel,
                           par.pp, par.schedule, par.dp_mode, model)  # fmt: skip
    check_dp_mode(par.dp_mode, par.tp, par.pp, mem.zero, t.precision, mem.offload)


def check_memory(mem: MemoryConfig, par: ParallelConfig, t: TrainConfig) -> None:
    """ZeRO and its offload, resharding under a pipeline, recompute and activations."""
    check_recompute(mem.recompute)
    check_activation_offload(mem.offload_activations)
    check_partition_activations(mem.partition_activations, par.tp, mem.recompute,
                                par.sequence_parallel, par.two_bw)  # fmt: skip
    check_zero(mem.zero, mem.offload, mem.offload_dir, par.pp, t.precision, t.reduce_dtype,
               par.schedule)  # fmt: skip
    check_reshard(mem.reshard_after_forward, mem.zero, par.pp)


def check_lora(
    lora: LoRAConfig, par: ParallelConfig, t: TrainConfig, model: ModelConfig, init_from: str
) -> None:
    """`--base-dtype` names a dtype, needs `--lora-rank`, and is honoured by the engine that
    runs: the ZeRO engine holds the frozen base in it (parallel/zero/frozen.py); naive data
    parallelism and 2BW keep every parameter in the precision's dtype. A folder saved 4-bit
    is read only as an NF4 base. The model's record of its adapters is [lora]'s, copied when
    the config was built: a section changed after that, and not the model, is a bug."""
    record = {k: getattr(model, name) for k, name in MODEL_LORA.items()}
    if lora.rank is not None and record != {k: getattr(lora, k) for k in MODEL_LORA}:
        raise ConfigError(f"[lora] {dataclasses.asdict(lora)} is not the model's {record}")
    base = parse_base_dtype(lora.base_dtype, t.precision, model.lora is not None)
    changed = base != parse_precision(t.precision).param_dtype or lora.base_dtype == "nf4"
    if changed and (par.dp_mode == "naive" or par.two_bw):
        engine = "--dp-mode naive" if par.dp_mode == "naive" else "--schedule 2bw"
        raise ConfigError(
            f"--base-dtype {lora.base_dtype} is held by the ZeRO engine only; {engine} keeps "
            f"the base in the precision's dtype ({t.precision}): give --base-dtype auto"
        )
    check_nf4_run(lora.base_dtype, par.tp, model, init_from)
    if lora.base_upcast:
        check_upcast(lora.base_dtype, t.precision, t.reduce_dtype)


def check_vocab(data: DataConfig, model: ModelConfig) -> None:
    if data.tokenizer_hash is None and model.vocab_size < 256:
        raise ConfigError(
            f"model.vocab_size {model.vocab_size} is smaller than the byte tokenizer's 256"
        )
