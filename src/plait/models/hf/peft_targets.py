"""Which Linears a PEFT adapter_config.json adapts, found the way PEFT itself finds them.

PEFT (0.21) walks the Hugging Face model's `named_modules()` and asks of each module name
(`model.layers.0.self_attn.q_proj`) whether the config targets it (`check_target_module_exists`
in peft/tuners/tuners_utils.py): `target_modules` as a string is a regular expression the whole
name must match; as a list, the name itself or any dotted suffix of it (`q_proj`,
`self_attn.q_proj`, or the full path, which is what PEFT writes after `"all-linear"`);
`"all-linear"` is every Linear (and GPT-2 Conv1D) but the output head; `exclude_modules` takes
names out the same two ways; `layers_to_transform` keeps, of the names a list matched by a
suffix, those whose first numbered segment (after `layers_pattern`, if given) is one of them.

plait adapts the same Linears in every block, so the set PEFT finds is mapped back to plait's
targets only when it is exactly that: a module outside a block's Linears (the head, an
embedding, a whole attention) or a target in some layers only is refused, naming it.
"""

from __future__ import annotations

import re
from typing import Any

from plait.errors import ConfigError
from plait.models.architecture import ModelConfig
from plait.models.block_table import table_for
from plait.models.hf.mapping import block_linears, pieces

ALL_LINEAR = "all-linear"  # PEFT's INCLUDE_LINEAR_LAYERS_SHORTHAND


def hf_modules(cfg: ModelConfig) -> set[str]:
    """The names `named_modules()` gives for `cfg`'s Hugging Face model: every dotted prefix
    of its tensors' names, and the output head (tied, it has no tensor of its own)."""
    names = {"lm_head"}
    for piece in pieces(cfg).values():
        parts = piece.hf_name.split(".")[:-1]
        names.update(".".join(parts[: n + 1]) for n in range(len(parts)))
    return names


def block_modules(cfg: ModelConfig) -> dict[str, list[tuple[int, str]]]:
    """Each block Linear's full module name -> the (layer, plait leaf) it holds (GPT-2's
    c_attn holds wq, wk and wv)."""
    base = pieces(cfg)
    out: dict[str, list[tuple[int, str]]] = {}
    for i in range(cfg.n_layers):
        for leaf in block_linears(cfg.arch):
            module = base[f"blocks.{i}.{leaf}.weight"].hf_name.removesuffix(".weight")
            out.setdefault(module, []).append((i, leaf))
    return out


def _in_list(names: list[str], key: str) -> bool:
    return key in names or any(key.endswith("." + n) for n in names)


def _layer(config: dict[str, Any], key: str) -> int | None:
    """The layer index PEFT reads from a module name: the first numbered segment, after
    `layers_pattern` when the config names one."""
    patterns = config.get("layers_pattern") or []
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        match = None
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
    return int(match["idx"]) if match else None


def targeted(config: dict[str, Any], key: str) -> bool:
    """PEFT's check_target_module_exists for module `key` (target_modules already a pattern
    string or a list of names; modules_to_save is refused before this is asked)."""
    excluded = config.get("exclude_modules")
    if isinstance(excluded, str) and re.fullmatch(excluded, key):
        return False
    if isinstance(excluded, list) and _in_list(excluded, key):
        return False
    targets = config["target_modules"]
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:  # named in full: layers_to_transform does not apply (PEFT's order)
        return True
    if not _in_list(targets, key):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    index = _layer(config, key)
    return index is not None and (index == layers if isinstance(layers, int) else index in layers)


def _checked(config: dict[str, Any], blocks: dict[str, Any], where: str) -> dict[str, Any]:
    """The config with target_modules as PEFT matches it ("all-linear" expanded), its
    patterns checked; ConfigError naming a value PEFT could not use either."""
    given = config.get("target_modules")
    if isinstance(given, str) and given.lower() == ALL_LINEAR:
        given = sorted(blocks)  # every Linear but the output head, by its full name
    strings = isinstance(given, list) and given and all(isinstance(t, str) for t in given)
    if not (isinstance(given, str) or strings):
        raise ConfigError(
            f"{where}: target_modules={given!r} is neither a list of module names nor a "
            "regular expression"
        )
    for field in ("target_modules", "exclude_modules"):
        value = given if field == "target_modules" else config.get(field)
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as e:
                raise ConfigError(
                    f"{where}: {field}={value!r} is no regular expression: {e}"
                ) from None
    return {**config, "target_modules": given}


def peft_targets(config: dict[str, Any], cfg: ModelConfig, where: str) -> str:
    """An adapter_config.json's targets on `cfg`'s base as plait's --lora-targets ('' for
    PEFT's default, which is plait's), or ConfigError naming what plait cannot adapt."""
    if config.get("target_modules") is None:
        return ""
    blocks = block_modules(cfg)
    config = _checked(config, blocks, where)
    given = config["target_modules"]  # a list in the order PEFT saved its set: sorted to show
    shown = f"target_modules={sorted(given) if isinstance(given, list) else given!r:.120}"
    hit = sorted(k for k in hf_modules(cfg) if targeted(config, k))
    known = ", ".join(sorted({m.split(".")[-1] for m in blocks}))
    if not hit:
        raise ConfigError(f"{where}: {shown} match no module of the base; its Linears: {known}")
    outside = [k for k in hit if k not in blocks]
    arch = table_for(cfg.arch).name
    if outside:
        raise ConfigError(
            f"{where}: {shown} adapt {outside[0]!r} ({len(outside)} such), which is not a "
            f"Linear of a {arch} block that plait adapts; those are: {known}"
        )
    layers: dict[str, set[int]] = {}
    for key in hit:
        for i, leaf in blocks[key]:
            layers.setdefault(leaf, set()).add(i)
    for leaf, where_on in layers.items():
        if len(where_on) != cfg.n_layers:
            why = config.get("layers_to_transform")
            cause = f"layers_to_transform={why!r}" if why not in (None, []) else shown
            raise ConfigError(
                f"{where}: {cause} adapts {block_linears(cfg.arch)[leaf]} in layers "
                f"{sorted(where_on)} of {cfg.n_layers} only; plait adapts a target in every layer"
            )
    return ",".join(name for name, leaf in table_for(cfg.arch).targets.items() if leaf in layers)
