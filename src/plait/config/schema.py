"""The run's configuration: one section per concern, assembled from defaults, a model preset
and per-section overrides (a TOML file's tables, the command line's flags).

The sections follow torchtitan's JobConfig (one dataclass per concern; [checkpoint] holds
the weights a run starts from) with DeepSpeed's names where they are the better known:
[model] the architecture (`ModelConfig`, with `preset` in a TOML file), [lora], [parallel],
[memory], [train], [optim], [data], [checkpoint], [log]. A key that lived in another
section before (`lr`, once under train) is refused naming its place now (`MOVED`).

Nothing here reads a file: following a tokenizer, measuring a corpus and reading a Hugging
Face or PEFT folder into a config are the pre-launch checks' (`plait.preflight`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from plait.config import checks
from plait.config.layout_sections import (
    MODEL_LORA,
    LoRAConfig,
    MemoryConfig,
    ParallelConfig,
)
from plait.config.loop_sections import (
    CheckpointConfig,
    DataConfig,
    LogConfig,
    OptimConfig,
    TrainConfig,
)
from plait.config.types import check_types
from plait.device import device_kind
from plait.domain import check_fields
from plait.errors import ConfigError
from plait.models.architecture import ModelConfig
from plait.models.presets import get_preset


@dataclass
class Config:
    """Everything a run needs; `model` is resolved from `preset` plus overrides."""

    preset: str = "small-gpt"
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def accumulation(self) -> int:
        return self.train.global_batch // (self.train.micro_batch * self.parallel.dp)

    def validate(self) -> None:
        """Every section's checks (`validate_config`); no file is read."""
        validate_config(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "lora": LoRAConfig,
    "parallel": ParallelConfig,
    "memory": MemoryConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
}

MOVED: dict[tuple[str, str], tuple[str, str]] = {
    **{("model", f"lora_{k}"): ("lora", k) for k in ("rank", "alpha", "dropout", "targets")},
    ("parallel", "base_dtype"): ("lora", "base_dtype"),
    ("parallel", "base_upcast"): ("lora", "base_upcast"),
    ("train", "adapter"): ("lora", "adapter"),
    **{("parallel", k): ("memory", k) for k in ("zero", "reshard_after_forward", "offload",
       "offload_dir", "recompute", "offload_activations", "partition_activations")},
    **{("parallel", k): ("train", k) for k in ("precision", "reduce_dtype", "packed_attention")},
    **{("train", k): ("optim", k) for k in ("lr", "lr_schedule", "min_lr", "warmup_steps",
       "warmup_ratio", "weight_decay", "beta1", "beta2", "grad_clip")},
    **{("train", k): ("checkpoint", k) for k in ("save", "save_every", "keep_checkpoints",
       "keep_best", "resume", "init_from", "init_from_sha256")},
    **{("train", k): ("log", k) for k in ("out", "overwrite", "tensorboard", "progress", "trace",
       "peak_flops")},
}  # fmt: skip
"""(old section, key) -> (section, key) now, for keys the split into concerns moved."""


def saved_config(config: dict[str, Any]) -> dict[str, Any]:
    """A saved `Config.to_dict()` (a checkpoint's trainer.json) in today's sections: one
    written before the split into concerns has its moved keys at their old places, which
    `MOVED` maps (the model keeps its record of the adapters, `lora_*`, and [lora] gets a
    copy). A new dict; one already in today's layout comes back equal. Reading back what plait
    itself wrote, unlike a user's TOML, whose old keys are refused (`check_sections`)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for (section, key), (new, name) in MOVED.items():
        old = out.get(section)
        if not isinstance(old, dict) or key not in old:
            continue
        value = old[key] if section == "model" else old.pop(key)
        out.setdefault(new, {}).setdefault(name, value)
    return out


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def check_sections(overrides: dict[str, dict[str, Any]]) -> None:
    """Every section and key known; a moved key refused in one line naming its new place."""
    for section, values in overrides.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section [{section}]; known: {', '.join(SECTIONS)}")
        names = {f.name for f in dataclasses.fields(SECTIONS[section])}
        for key in values:
            if (section, key) in MOVED:
                new, name = MOVED[(section, key)]
                raise ConfigError(
                    f"[{section}] {key} has moved: write it as [{new}] {name} "
                    "(docs/running.md lists the sections)"
                )
            if key not in names or (section == "model" and key in MODEL_LORA.values()):
                raise ConfigError(
                    f"unknown key {key!r} in [{section}]; known: {', '.join(sorted(names))}"
                )


def build_config(
    preset: str, overrides: dict[str, dict[str, Any]], model: ModelConfig | None = None
) -> Config:
    """Preset model (or `model`, e.g. a Hugging Face folder's) + per-section overrides ->
    Config; unknown and moved keys are errors. The model records [lora]'s adapters."""
    check_sections(overrides)
    cfg = Config(preset=preset, model=model or get_preset(preset))
    for section, values in overrides.items():
        target = getattr(cfg, section)
        for key, value in values.items():
            setattr(target, key, value)
    for key, model_key in MODEL_LORA.items():
        setattr(cfg.model, model_key, getattr(cfg.lora, key))
    derive_micro_batch(cfg)
    return cfg


def derive_micro_batch(cfg: Config) -> None:
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


def validate_config(cfg: Config) -> None:
    """Everything checkable before workers start without reading a file, one section at a
    time, then what spans sections; the first problem found is raised (ConfigError). The
    corpus is measured by `plait.preflight.check_run`."""
    for section in SECTIONS:  # a TOML string where a number belongs, before anything else
        check_types(section, getattr(cfg, section), check_choices=section != "model")
    check_fields("lora", cfg.lora)  # named as given (the model's lora_* are copies)
    cfg.model.validate()  # the model's problems first (its domains included)
    for section in SECTIONS:
        if section not in ("model", "lora"):
            check_fields(section, getattr(cfg, section))
    checks.check_train(cfg.train, cfg.parallel, cfg.model)
    checks.check_memory(cfg.memory, cfg.parallel, cfg.train)
    checks.check_optim(cfg.optim)
    checks.check_checkpoint(cfg.checkpoint, cfg.train)
    checks.check_parallel(cfg.parallel, cfg.memory, cfg.train, cfg.model, cfg.accumulation)
    checks.check_lora(cfg.lora, cfg.parallel, cfg.train, cfg.model, cfg.checkpoint.init_from)
    checks.check_log(cfg.log)
    checks.check_vocab(cfg.data, cfg.model)


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
    if t.precision == "fp16" and device_kind(t.device) == "cpu":
        out.append(
            "fp16 on a CPU runs about 10x slower than fp32 (torch's CPU fp16 matmul); "
            "--precision bf16 is fast here"
        )
    return out
