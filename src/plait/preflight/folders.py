"""`--init-from`'s Hugging Face folder and `--adapter`'s PEFT folder, read into a run's
config before any worker starts: the folder's model config (explicit model values must agree
with it), the tokenizer a run reads its data with, and the adapter's LoRA settings (explicit
[lora] values must agree with them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plait.data.examples import is_examples_dir
from plait.data.shards import is_shard_dir, shard_tokenizer
from plait.data.tokenizer import resolve_tokenizer
from plait.errors import ConfigError
from plait.models.architecture import ModelConfig
from plait.models.hf.load import load_config
from plait.models.hf.peft import adapter_model_fields, check_adapter, read_adapter_config
from plait.models.lora import parse_targets

FREE_MODEL_FIELDS = frozenset({"dropout"})
"""A training choice, not the architecture: an explicit value never conflicts with a folder."""
PEFT_FIELDS = {"lora_rank": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
               "lora_targets": "target_modules"}  # fmt: skip
"""ModelConfig's LoRA fields -> the adapter_config.json field each comes from."""


def init_model(
    folder: str,
    explicit: dict[str, Any],
    preset: str | None,
    adapter: str = "",
    lora: dict[str, Any] | None = None,
) -> ModelConfig:
    """`--init-from`'s model config; explicit [model] values must agree with it (dropout
    aside), and explicit LoRA values (`lora`, in ModelConfig's names: `lora_rank`...) with
    `--adapter`'s folder, whose rank and targets it takes. LoRA's adapters are added to the
    folder's model, which stays their frozen base."""
    if preset:
        raise ConfigError(f"--model {preset} and --init-from {folder} both name the model")
    cfg = load_config(Path(folder))
    for key, value in explicit.items():
        if key in FREE_MODEL_FIELDS:
            setattr(cfg, key, value)
        elif not hasattr(cfg, key):
            raise ConfigError(f"unknown key {key!r} in [model]")
        elif getattr(cfg, key) != value:
            raise ConfigError(
                f"model.{key}={value!r} conflicts with model.{key}={getattr(cfg, key)!r} "
                f"from --init-from {folder}"
            )
    for key, value in (lora or {}).items():
        setattr(cfg, key, value)
    if adapter:
        apply_adapter(cfg, adapter, lora or {})
    return cfg


def init_tokenizer(folder: str, path: str | None, given: str | None) -> str | None:
    """The tokenizer a run from `--init-from folder` reads `--data path` with. A folder with
    a tokenizer.json speaks its ids: raw text is tokenized with it (not as bytes, which would
    feed a 32K-token model ids 0-255), and a --tokenizer or text shards made with another
    tokenizer are refused, naming both (instruction examples: `check_examples`). A folder
    without one leaves `given` (bytes if none) as it is."""
    if not (Path(folder) / "tokenizer.json").is_file():
        return given
    own = resolve_tokenizer(folder)
    if is_examples_dir(path):
        return given
    if is_shard_dir(path):
        made = shard_tokenizer(path, None)
        if made.identity != own.identity:
            raise ConfigError(
                f"shards {path!r} were made with tokenizer {made.name}"
                + (f" (sha256 {made.identity})" if made.identity else "")
                + f", not with --init-from {folder}'s; prepare them again with --tokenizer {folder}"
            )
        return given
    if given and resolve_tokenizer(given).identity != own.identity:
        raise ConfigError(
            f"--tokenizer {given} is not --init-from {folder}'s tokenizer (sha256 "
            f"{resolve_tokenizer(given).identity} vs {own.identity}): the model's ids are its "
            "own tokens; leave --tokenizer out"
        )
    return given or folder


def apply_adapter(cfg: ModelConfig, adapter: str, explicit: dict[str, Any]) -> None:
    """Set `cfg`'s LoRA fields from a PEFT folder's adapter_config.json (an explicit value
    that disagrees is refused, naming both) and check its tensors against the base's shapes."""
    folder = Path(adapter)
    config = read_adapter_config(folder)
    fields = adapter_model_fields(config, cfg, str(folder / "adapter_config.json"))
    for key, value in fields.items():
        if key in explicit and not _same(key, explicit[key], value, cfg.arch):
            theirs = PEFT_FIELDS[key]
            raise ConfigError(
                f"{key.replace('_', '.', 1)}={explicit[key]!r} conflicts with {theirs}="
                f"{config.get(theirs, value)!r} from --adapter {adapter}"
            )
        setattr(cfg, key, value)
    cfg.validate()
    check_adapter(folder, cfg)


def _same(key: str, given: Any, implied: Any, arch: str) -> bool:
    """Whether an explicit LoRA value means what the adapter's does ('all' is the list)."""
    if key == "lora_targets":
        return parse_targets(given, arch) == parse_targets(implied, arch)
    return given == implied
