"""PEFT LoRA adapters in and out: the `adapter_config.json` and `adapter_model.safetensors`
that `PeftModel.save_pretrained` writes, so PEFT loads plait's adapters and plait PEFT's.

PEFT names each tensor by the Hugging Face module it adapts ('base_model.model.' + module +
'.lora_A.weight', no adapter name) and stores A as (r, in) and B as (out, r) whatever the
module stores: GPT-2's Conv1D keeps (in, out) weights, but PEFT's `fan_in_fan_out` only
transposes the merged update, never A or B. So the map is the base model's (mapping.py): a
target's module is its weight's Hugging Face name without '.weight', and the B of GPT-2's q, k
and v are row ranges of c_attn's B at the offsets their weights have in c_attn (A is wq's).

Reading maps target_modules (names, full paths, a pattern, "all-linear"), layers_to_transform
and exclude_modules as PEFT does (peft_targets.py), refuses what plait's adapters cannot
compute (DoRA, rsLoRA, per-module ranks, a target in some layers only, trained biases or
extra modules, a target that is not a block's Linear, a base rewritten by its init), naming the
field, and checks every tensor's shape against the base before a worker starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from plait.errors import ConfigError
from plait.models.architecture import ModelConfig
from plait.models.hf.config_json import family, read_json_object
from plait.models.hf.load import region_source
from plait.models.hf.mapping import Piece, assemble, block_linears, pieces
from plait.models.hf.peft_targets import peft_targets
from plait.models.init import ValueSource
from plait.models.transformer import Transformer
from plait.outdir import atomic_folder

PREFIX = "base_model.model."
CONFIG, WEIGHTS, PICKLE = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"
NOT_PLAIN_LORA = ("use_dora", "use_rslora", "lora_bias", "rank_pattern", "alpha_pattern",
                  "layer_replication", "modules_to_save", "trainable_token_indices",
                  "target_parameters", "alora_invocation_tokens", "use_bdlora",
                  "use_qalora", "velora_config", "monteclora_config", "arrow_config",
                  "kasa_config")  # fmt: skip
"""adapter_config.json fields that change what the adapter computes or which modules it
holds: each must be off (false, null or empty) for plait to compute what PEFT computes.
(Which Linears it adapts, layers_to_transform and exclude_modules included: peft_targets.py.)"""
PLAIN_INIT = (True, False, "gaussian", "eva", "orthogonal")
"""init_lora_weights that only choose A and B's first values; the others (pissa, olora, corda,
loftq, lora_ga, ...) also rewrite the base's weights, which the adapter then needs."""


def adapter_pieces(cfg: ModelConfig) -> dict[str, Piece]:
    """Every adapter parameter of `cfg` (single-process name) -> its place in PEFT's file."""
    spec = cfg.lora
    if spec is None:
        return {}
    base = pieces(cfg)
    out: dict[str, Piece] = {}
    for i in range(cfg.n_layers):
        for leaf in spec.leaves:
            weight = base[f"blocks.{i}.{leaf}.weight"]
            module = PREFIX + weight.hf_name.removesuffix(".weight")
            if spec.has_a(leaf):
                out[f"blocks.{i}.{leaf}.lora_a"] = Piece(f"{module}.lora_A.weight")
            b = Piece(f"{module}.lora_B.weight", False, weight.offset)  # q, k, v in c_attn
            out[f"blocks.{i}.{leaf}.lora_b"] = b
    return out


def adapter_tensors(cfg: ModelConfig, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """Full single-process adapter tensors (plait names; other names ignored) -> PEFT's
    safetensors keys (GPT-2's q, k, v B stacked into c_attn's)."""
    table = adapter_pieces(cfg)
    missing = sorted(set(table) - set(params))
    if missing:
        raise ConfigError(f"the weights hold no adapter tensor {missing[0]!r} (of {len(table)})")
    return assemble(table, params)


def _target_modules(cfg: ModelConfig) -> list[str]:
    """PEFT's target_modules for `cfg`'s targets: each module by the shortest suffix of its
    path that names it alone among a block's Linears (GPT-2's c_proj is in attn and mlp)."""
    linears = block_linears(cfg.arch)
    modules = set(linears.values())
    out = set()
    for leaf in cfg.lora.leaves:
        parts = linears[leaf].split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if len(_matching(suffix, modules)) == 1:
                out.add(suffix)
                break
    return sorted(out)


def _matching(target: str, modules: set[str]) -> set[str]:
    """The modules PEFT's list entry `target` adapts: the name itself or a dotted suffix."""
    return {m for m in modules if m == target or m.endswith("." + target)}


def adapter_config(cfg: ModelConfig, base: str) -> dict[str, Any]:
    """adapter_config.json for `cfg`'s adapters on the base model at `base` (a path or a hub
    name; '' when the run's base was seeded, which PEFT cannot load on its own)."""
    spec = cfg.lora
    if spec is None:
        raise ConfigError("the model has no LoRA adapters (--lora-rank): nothing to describe")
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base or None,
        "r": spec.rank,
        "lora_alpha": alpha,
        "lora_dropout": spec.dropout,
        "target_modules": _target_modules(cfg),
        "fan_in_fan_out": family(cfg) == "gpt2",  # Conv1D stores (in, out)
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def save_adapter(out: Path, cfg: ModelConfig, params: dict[str, Tensor], base: str) -> None:
    """Write `cfg`'s adapters from `params` as a PEFT folder at `out` (absent or empty),
    whole or not at all; an adapter with no tensors is refused, never written."""
    tensors = adapter_tensors(cfg, params)
    if not tensors:
        raise ConfigError("no adapter tensors to write: the model has no LoRA adapters")
    config = adapter_config(cfg, base)
    with atomic_folder(out) as tmp:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2))
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})


def read_adapter_config(folder: Path) -> dict[str, Any]:
    """A PEFT folder's adapter_config.json, or ConfigError naming what is wrong."""
    return read_json_object(folder, CONFIG, "--adapter", "a PEFT adapter folder",
                            " (a PEFT adapter folder)")  # fmt: skip


def _weights_file(folder: Path) -> Path:
    file = folder / WEIGHTS
    if file.is_file():
        return file
    if (folder / PICKLE).is_file():
        raise ConfigError(
            f"--adapter {str(folder)!r} holds {PICKLE} (a pickle), which plait does not run; "
            f"save the adapter again with safe_serialization=True ({WEIGHTS})"
        )
    raise ConfigError(f"--adapter {str(folder)!r} has no {WEIGHTS}")


def read_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A PEFT folder's config and tensors (by PEFT's keys); ConfigError naming the folder."""
    config = read_adapter_config(folder)
    file = _weights_file(folder)
    try:
        return config, load_file(str(file))
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"{str(file)!r} is not a readable safetensors file: {e}") from e


def _shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The adapter's tensor shapes from the safetensors header (no data read)."""
    file = _weights_file(folder)
    try:
        with safe_open(str(file), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"{str(file)!r} is not a readable safetensors file: {e}") from e


def _number(config: dict[str, Any], field: str, where: str, default: float | None) -> Any:
    value = config.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: {field}={value!r} is not a number")
    return value


def adapter_model_fields(
    config: dict[str, Any], cfg: ModelConfig, where: str = CONFIG
) -> dict[str, Any]:
    """The ModelConfig lora_* values an adapter_config.json implies for the base `cfg`;
    ConfigError naming the field plait cannot represent."""
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{where}: peft_type={config.get('peft_type')!r} is not LORA")
    for field in NOT_PLAIN_LORA:
        if config.get(field):
            raise ConfigError(
                f"{where}: {field}={config[field]!r} is not plain LoRA; plait cannot compute it"
            )
    init = config.get("init_lora_weights", True)
    if not any(init is p or (isinstance(p, str) and init == p) for p in PLAIN_INIT):
        raise ConfigError(
            f"{where}: init_lora_weights={init!r} also rewrites the base's weights, which this "
            "adapter needs; plait reads the base as its folder holds it"
        )
    if config.get("bias", "none") != "none":
        raise ConfigError(f"{where}: bias={config['bias']!r} trains biases; plait needs 'none'")
    rank = _number(config, "r", where, None)
    alpha = _number(config, "lora_alpha", where, 8)  # PEFT's default
    dropout = _number(config, "lora_dropout", where, 0.0)
    if not isinstance(rank, int) or rank < 1 or alpha <= 0 or not 0 <= dropout < 1:
        raise ConfigError(
            f"{where}: r={rank!r}, lora_alpha={alpha!r}, lora_dropout={dropout!r} are not a "
            "LoRA (r >= 1, alpha > 0, 0 <= dropout < 1)"
        )
    return {
        "lora_rank": rank,
        "lora_alpha": float(alpha),
        "lora_dropout": float(dropout),
        "lora_targets": peft_targets(config, cfg, where),
    }


def check_adapter(folder: Path, cfg: ModelConfig) -> None:
    """Every tensor `cfg`'s adapters need is in the folder with its shape, and the folder
    holds nothing else (headers only): an adapter for another base is refused, naming both."""
    _check(folder, _shapes(folder), cfg)


def _check(folder: Path, shapes: dict[str, tuple[int, ...]], cfg: ModelConfig) -> None:
    with torch.device("meta"):
        params = dict(Transformer(cfg).named_parameters())
    want = {k: tuple(t.shape) for k, t in adapter_tensors(cfg, params).items()}
    for key, shape in want.items():
        if key not in shapes:
            raise ConfigError(
                f"--adapter {str(folder)!r} has no tensor {key!r}, which the targets need"
            )
        if shapes[key] != shape:
            raise ConfigError(
                f"--adapter {str(folder)!r}: tensor {key!r} has shape {list(shapes[key])}, "
                f"the base model needs {list(shape)} (an adapter for another base?)"
            )
    extra = sorted(set(shapes) - set(want))
    if extra:
        raise ConfigError(
            f"--adapter {str(folder)!r} holds tensor {extra[0]!r}, which the base model has no "
            f"place for ({len(extra)} such; an adapter for another base?)"
        )


def adapter_source(folder: Path, cfg: ModelConfig) -> ValueSource:
    """The folder's adapters as plait parameters (each rank reading its slices of them),
    checked against `cfg`'s shapes first."""
    _, tensors = read_adapter(folder)
    _check(folder, {k: tuple(t.shape) for k, t in tensors.items()}, cfg)
    return region_source(cfg, adapter_pieces(cfg), lambda key, region: tensors[key][region])
