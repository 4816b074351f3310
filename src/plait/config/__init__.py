"""A run's configuration: typed sections, one concern each, whose field help strings are
the command line's help.

  layout_sections.py  [parallel] the split, [memory] ZeRO/offload/recompute, [lora] adapters
  loop_sections.py    [data], [train], [optim], [checkpoint], [log]
  types.py            a field's type from its annotation (typing): the TOML check and the flags'
  checks.py           each section's checks (ConfigError naming the values)
  schema.py           `Config`, `SECTIONS`, the moved keys, `build_config`, `validate_config`

A run's config comes from (lowest to highest precedence) the dataclass defaults, a model
preset, a TOML file, and command-line flags. Nothing in this package reads a file, so the
engines under parallel/ may import it: following a tokenizer, measuring the corpus and
reading Hugging Face or PEFT folders are the pre-launch checks' (`plait.preflight`).
"""

from plait.config.layout_sections import LoRAConfig, MemoryConfig, ParallelConfig
from plait.config.loop_sections import (
    LR_SCHEDULES,
    CheckpointConfig,
    DataConfig,
    LogConfig,
    OptimConfig,
    TrainConfig,
)
from plait.config.schema import (
    MOVED,
    SECTIONS,
    Config,
    build_config,
    config_warnings,
    flag_name,
    saved_config,
    validate_config,
)

__all__ = [
    "LR_SCHEDULES",
    "MOVED",
    "SECTIONS",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LoRAConfig",
    "LogConfig",
    "MemoryConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "build_config",
    "config_warnings",
    "flag_name",
    "saved_config",
    "validate_config",
]
