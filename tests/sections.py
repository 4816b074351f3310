"""`regroup`: overrides that test helpers collect by their old home (keyword arguments of a
helper that once fed one section), each key placed in the section that holds it now
(`plait.config.MOVED`). For tests' helpers only: a config file or a flag with an old key is
refused (tests/test_config_sections.py)."""

from __future__ import annotations

from typing import Any

from plait.config import MOVED, Config, build_config
from plait.models.architecture import ModelConfig


def regroup(overrides: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for section, values in overrides.items():
        for key, value in values.items():
            new, name = MOVED.get((section, key), (section, key))
            out.setdefault(new, {})[name] = value
    return out


def build_regrouped(
    preset: str, overrides: dict[str, dict[str, Any]], model: ModelConfig | None = None
) -> Config:
    """`build_config` of `regroup(overrides)`."""
    return build_config(preset, regroup(overrides), model)


def set_option(cfg: Config, section: str, key: str, value: Any) -> None:
    """Set `section.key` on a built config, where that key lives now (`regroup`'s rule)."""
    new, name = MOVED.get((section, key), (section, key))
    setattr(getattr(cfg, new), name, value)
