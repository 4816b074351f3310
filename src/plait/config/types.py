"""A config field's type, read from its annotation with `typing`: the one rule the TOML check
(`check_types`) and the command line's flag generation (`plait.cli.run_flags`) share.

A field is annotated with a scalar (`bool`, `int`, `float`, `str`), optionally `| None`, or a
`Literal[...]` of its choices; nothing else is allowed in a section (`field_kind` refuses it,
so a new field cannot slip past the check).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from plait.errors import ConfigError

SCALARS = (bool, int, float, str)


def field_types(cls: type) -> dict[str, Any]:
    """Each field's annotation of dataclass `cls`, evaluated (`from __future__ import
    annotations` leaves them as strings)."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _parts(tp: Any) -> tuple[list[Any], bool]:
    """`int | None` -> ([int], True); `Literal['a', 'b']` -> ([Literal['a', 'b']], False)."""
    if get_origin(tp) in (Union, types.UnionType):
        args = get_args(tp)
        return [a for a in args if a is not type(None)], type(None) in args
    return [tp], False


def choices(tp: Any) -> tuple[Any, ...] | None:
    """A Literal's choices (None for any other type)."""
    inner, _ = _parts(tp)
    return get_args(inner[0]) if get_origin(inner[0]) is Literal else None


def field_kind(tp: Any) -> type:
    """The scalar a field holds: `bool`, `int`, `float` or `str` (a Literal's, its choices')."""
    inner, _ = _parts(tp)
    if len(inner) != 1:
        raise TypeError(f"a config field holds one kind of value, not {tp}")
    kind = inner[0]
    if get_origin(kind) is Literal:
        kinds = {type(c) for c in get_args(kind)}
        if len(kinds) != 1:
            raise TypeError(f"a Literal's choices are of one kind, not {tp}")
        kind = kinds.pop()
    if kind not in SCALARS:
        raise TypeError(f"a config field is bool, int, float or str (or | None), not {tp}")
    return kind


def type_ok(tp: Any, value: Any) -> bool:
    """Whether `value` is of the annotation's kind (a bool is no number; an int is a float)."""
    _, optional = _parts(tp)
    if value is None:
        return optional
    kind = field_kind(tp)
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float)
    return isinstance(value, kind)


def describe(tp: Any) -> str:
    """`int`, `str | None`: the annotation as a TOML user reads it."""
    _, optional = _parts(tp)
    name = field_kind(tp).__name__
    return f"{name} | None" if optional else name


def check_types(section: str, obj: Any, check_choices: bool = True) -> None:
    """A TOML string where a number belongs (or a word outside a Literal's choices) fails
    here, naming `section.field`, not deep inside a worker."""
    for name, tp in field_types(type(obj)).items():
        value = getattr(obj, name)
        if not type_ok(tp, value):
            raise ConfigError(
                f"{section}.{name} must be {describe(tp)}, got {value!r} ({type(value).__name__})"
            )
        allowed = choices(tp)
        if check_choices and allowed and value not in allowed:
            listed = ", ".join(map(str, allowed))
            raise ConfigError(f"{name} must be one of {listed}; got {value!r}")
