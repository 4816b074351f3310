"""The flags of a run, shared by `plait train` and `plait estimate`, and the config they build.

Flags are generated from the config dataclasses (`plait.config`), so a field's help string is
its flag's help and a new field is a new flag. Precedence: defaults < model preset < TOML file
< flags; the result is validated before any worker starts.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plait.config import SECTIONS, Config, ParallelConfig, flag_name
from plait.config.layout_sections import MODEL_LORA
from plait.config.schema import check_sections
from plait.config.types import field_kind, field_types
from plait.domain import AUTO, Once
from plait.errors import ConfigError
from plait.launcher_env import Launched, auto_dp, from_environment
from plait.models.architecture import ModelConfig
from plait.models.lora import check_given_targets
from plait.models.presets import get_preset
from plait.preflight import check_run, configure

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


LORA_OPTIONS = ("alpha", "dropout", "targets")
"""[lora] fields that mean something only beside its rank (a flag or a TOML key)."""


def _add_section(parser: argparse.ArgumentParser, section: str, cls: type) -> None:
    group = parser.add_argument_group(section)
    types = field_types(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("derived"):  # computed from other fields, never given
            continue
        if section == "model" and f.name in MODEL_LORA.values():  # [lora]'s flags
            continue
        kind = field_kind(types[f.name])
        kwargs: dict[str, Any] = {"dest": f"{section}.{f.name}", "default": argparse.SUPPRESS}
        default = "the preset's" if section == "model" else f.default
        kwargs["help"] = f.metadata.get("help", "") + f" (default: {default})"
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.metadata.get("once"):
            kwargs["action"] = Once
        else:  # a number's domain (field metadata) converts it and is checked before a run
            kwargs["type"] = f.metadata.get("domain", kind)
            kwargs["metavar"] = kind.__name__.upper()
        group.add_argument(flag_name(f), **kwargs)


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a run, shared by `train` and `estimate` (every train flag estimates)."""
    parser.add_argument("--config", help="TOML file: " + " ".join(f"[{s}]" for s in SECTIONS))
    parser.add_argument("--model", dest="preset", help="model preset (see `plait presets`)")
    for section, cls in SECTIONS.items():
        _add_section(parser, section, cls)


def config_from_args(
    args: argparse.Namespace,
    check_data: bool = True,
    adjust: Callable[[Config], None] | None = None,
) -> Config:
    """Preset <- TOML <- flags, then validate (raises ConfigError); `check_data=False`
    leaves the corpus unread (the estimator needs only shapes); `adjust` sets what a command
    derives rather than takes (`plait eval`: the global batch), before validation."""
    overrides: dict[str, dict[str, Any]] = load_toml(args.config) if args.config else {}
    overrides = {k: dict(v) for k, v in overrides.items()}
    toml_preset = overrides.get("model", {}).pop("preset", None)
    check_sections(overrides)  # a moved or unknown key in the file, before anything else
    for dest, value in vars(args).items():
        if "." in dest:
            section, name = dest.split(".", 1)
            overrides.setdefault(section, {})[name] = value
    auto = overrides.get("parallel", {}).get("dp") == AUTO
    # a Slurm environment that contradicts itself is refused here, once, where it matters
    launch = from_environment() if check_data or auto else None
    if auto:
        resolve_auto_dp(overrides["parallel"], launch)
    lora_given = [k for k in LORA_OPTIONS if k in overrides.get("lora", {})]
    check_one_of(overrides)
    check_given_targets(overrides.get("lora", {}).get("targets"))
    cfg = _build(args, overrides, toml_preset)
    if adjust is not None:
        adjust(cfg)
    if lora_given and cfg.model.lora_rank is None:
        flags = ", ".join(f"--lora-{k}" for k in lora_given)
        raise ConfigError(
            f"{flags} given without --lora-rank: LoRA is off, so nothing would use "
            f"{'it' if len(lora_given) == 1 else 'them'}; add --lora-rank R (or drop {flags})"
        )
    if auto and launch is not None:
        check_auto_batch(cfg, launch)
    check_run(cfg, check_data)
    if check_data and launch is not None:  # every rank would otherwise fail alone, traced
        check_launched(cfg, launch)
    return cfg


def _build(
    args: argparse.Namespace, overrides: dict[str, dict[str, Any]], toml_preset: str | None
) -> Config:
    """The config of the preset, or of `--init-from`'s folder (with `--adapter`'s LoRA
    settings, which land in [lora]), its tokenizer followed."""
    preset = args.preset or toml_preset
    folder = overrides.get("checkpoint", {}).get("init_from")
    if folder and toml_preset and not args.preset and hasattr(args, "checkpoint.init_from"):
        preset = None  # a recipe's preset (for `estimate`) yields to the flag's folder ...
    adapter = overrides.get("lora", {}).get("adapter")
    if adapter and not folder:
        raise ConfigError(
            f"--adapter {adapter} needs --init-from BASE: the base model the adapter adapts"
        )
    if not folder:
        return configure(preset or "small-gpt", overrides)
    from plait.preflight.folders import init_model, init_tokenizer  # HF's reader: only here

    lora = overrides.setdefault("lora", {})  # the folder's model: explicit values must agree
    given = {MODEL_LORA[k]: v for k, v in lora.items() if k in MODEL_LORA}
    model = init_model(folder, overrides.pop("model", {}), preset, adapter or "", given)
    lora.update({k: getattr(model, name) for k, name in MODEL_LORA.items()})
    data = overrides.setdefault("data", {})
    data["tokenizer"] = init_tokenizer(folder, data.get("path"), data.get("tokenizer"))
    if toml_preset and preset is None:  # ... if it describes the same model
        check_same_shape(toml_preset, model, folder)
    return configure(f"hf:{folder}", overrides, model)


ONE_OF = (("train", "epochs", "steps"), ("optim", "warmup_ratio", "warmup_steps"))
"""Pairs that set the same thing (their section, the derived, the direct): given both
(flags or the config file), refused."""


def check_one_of(overrides: dict[str, dict[str, Any]]) -> None:
    """--epochs and --steps (or --warmup-ratio and --warmup-steps) both given: one line
    naming both values, rather than one silently winning. A zero ratio or epoch count
    means "not set" and is not counted."""
    for section, derived, direct in ONE_OF:
        given = overrides.get(section, {})
        if given.get(derived) and direct in given:
            a, b = (f"--{k.replace('_', '-')} {given[k]}" for k in (derived, direct))
            raise ConfigError(
                f"{a} and {b} both set the run's {direct.replace('_', ' ')} (flags or the "
                f"config file's [{section}]); give one"
            )


def resolve_auto_dp(parallel: dict[str, Any], launch: Launched | None) -> None:
    """`--dp auto` (or `dp = "auto"` in [parallel]) becomes the number that fills the
    launcher's world, before the config is built (its micro-batch arithmetic reads dp)."""
    default = ParallelConfig()  # a slots dataclass: its class holds no default values
    tp, pp = parallel.get("tp", default.tp), parallel.get("pp", default.pp)
    if not all(type(v) is int and v >= 1 for v in (tp, pp)):
        raise ConfigError(f"--dp auto needs whole tp and pp >= 1; got tp {tp!r}, pp {pp!r}")
    cp = parallel.get("cp", default.cp)  # a replica's context-parallel ranks
    parallel["dp"] = auto_dp(launch, tp, pp, cp if type(cp) is int and cp >= 1 else 1)


def check_auto_batch(cfg: Config, launch: Launched) -> None:
    """The global batch is the run's (a resumed run keeps it): with dp chosen by the world,
    the micro-batches per step are what changes, and they must come out whole."""
    t, par = cfg.train, cfg.parallel
    per_step = t.micro_batch * par.dp
    if t.global_batch % per_step:
        raise ConfigError(
            f"--dp auto: {launch.world_source} with tp {par.tp} x pp {par.pp} gives dp "
            f"{par.dp}, but global batch {t.global_batch} is not a multiple of micro-batch "
            f"{t.micro_batch} x dp {par.dp} = {per_step}; the global batch is kept, so "
            "choose a --micro-batch or a world that divides it"
        )


def check_launched(cfg: Config, launch: Launched) -> None:
    """A launcher's world must be the layout's; plait cannot restart a world it did not
    start (torchrun's --max-restarts, or a batch script's loop, does)."""
    try:
        cfg.parallel.layout.check_world(launch.world)
    except ConfigError as e:
        raise ConfigError(f"{launch.world_source}: {e} (or give --dp auto)") from None
    if cfg.train.max_restarts:
        how = "torchrun --max-restarts" if launch.launcher == "torchrun" else "srun again"
        raise ConfigError(
            f"--max-restarts {cfg.train.max_restarts} under {launch.launcher}: each process "
            f"is one rank and cannot restart the world; restart it with {how} and "
            "--resume latest (examples/slurm/)"
        )


def load_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a TOML config: the sections of `plait.config.SECTIONS` ([model] with `preset`)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a folder; give a TOML file")
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        with p.open("rb") as fh:
            raw = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(p)!r} is not text (a TOML file is UTF-8)") from None
    for key, value in raw.items():
        if not isinstance(value, dict):
            raise ConfigError(f"config file {str(p)!r}: top-level key {key!r} must be a [section]")
    return raw


SHAPE = ("n_layers", "d_model", "n_heads", "kv_heads", "vocab_size")


def check_same_shape(preset: str, model: ModelConfig, folder: str) -> None:
    """A config file's `[model] preset` with `--init-from` on the command line: the file is a
    recipe (its preset lets `plait estimate` size the run), the folder the model it runs;
    they must be one architecture, or the recipe's batch and memory plan were for another."""
    want = get_preset(preset)
    diff = [f"{k} {getattr(want, k)} vs {getattr(model, k)}" for k in SHAPE
            if getattr(want, k) != getattr(model, k)]  # fmt: skip
    if diff:
        raise ConfigError(
            f"the config file's preset {preset!r} is not --init-from {folder}'s model: "
            + ", ".join(diff)
        )
