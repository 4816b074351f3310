"""The Jinja environment chat templates render in, as transformers' `apply_chat_template` has it.

An immutable sandbox with `trim_blocks` and `lstrip_blocks`, the loop-controls extension
(`break`, `continue`), transformers' `tojson` (no HTML escaping, its indent/separators/
sort_keys options), `raise_exception(message)` and `strftime_now(format)` (today's date:
Llama-3.2's system header reads it), its guarded `dict` and `namespace`, and the
`{% generation %}` block transformers uses to mark the assistant's text
(`return_assistant_tokens_mask`).

Two choices of plait's own, neither changing what renders:
- A name the template reads that nobody passed is refused, naming it, instead of rendering
  as "" (transformers' lenient default): transformers fills such names from extra
  `apply_chat_template` arguments, which plait has none of, so the text would silently differ
  from what the template's authors meant. Testing it (`x is defined`, `x | default(...)`,
  `x is none`) is fine; a missing key of a message (`message.tool_calls`) stays lenient, as
  in transformers, since templates read optional message fields all the time.
- `{% generation %}` blocks are found by wrapping their output in two Unicode
  noncharacters (U+FDD0, U+FDD1, reserved for a program's internal use), removed after
  rendering; a conversation holding either is refused.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from jinja2 import Undefined, nodes
from jinja2.exceptions import SecurityError, TemplateError, UndefinedError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, missing

START, END = "\ufdd0", "\ufdd1"  # around a {% generation %} block's output while rendering


class NotProvided(UndefinedError):
    """A template used a top-level name that was not passed to it."""

    def __init__(self, name: str) -> None:
        super().__init__(f"reads {name!r}")
        self.name = name


class _Undefined(Undefined):
    """Lenient (as transformers) for missing keys of given values; refuses, naming it, a
    missing top-level name that is used rather than tested."""

    __slots__ = ()

    def _top(self) -> bool:
        return self._undefined_obj is missing and isinstance(self._undefined_name, str)

    def _fail_with_undefined_error(self, *args: Any, **kwargs: Any):
        if self._top():
            raise NotProvided(self._undefined_name)
        raise self._undefined_exception(self._undefined_message)  # Jinja's own failure

    def __str__(self) -> str:
        return self._fail_with_undefined_error() if self._top() else ""

    def __iter__(self):
        return self._fail_with_undefined_error() if self._top() else iter(())

    def __bool__(self) -> bool:
        return self._fail_with_undefined_error() if self._top() else False

    def __len__(self) -> int:
        return self._fail_with_undefined_error() if self._top() else 0

    def __eq__(self, other: object) -> bool:
        return self._fail_with_undefined_error() if self._top() else type(self) is type(other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return id(type(self))

    # Jinja binds its operators to the base class's failing method: bind them to this one.
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _fail_with_undefined_error
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = _fail_with_undefined_error
    __mod__ = __rmod__ = __pos__ = __neg__ = __pow__ = __rpow__ = _fail_with_undefined_error
    __call__ = __getitem__ = __lt__ = __le__ = __gt__ = __ge__ = _fail_with_undefined_error
    __int__ = __float__ = __complex__ = _fail_with_undefined_error


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: the block's output, marked."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_mark")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _mark(self, caller) -> str:
        return START + caller() + END


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' override: Jinja's own tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Dict:
    """`dict(...)` in a template: the mapping only, not the type (transformers' guard)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(Namespace):
    """`namespace(...)` refusing underscore names, as transformers' (no CPython insides)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature: `self` may be a key
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a chat template cannot set {name!r} on a namespace")


def environment() -> ImmutableSandboxedEnvironment:
    """A fresh environment with transformers' settings and helpers."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols],
        undefined=_Undefined,
    )  # fmt: skip
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def has_generation(text: str) -> bool:
    """Whether a template marks the assistant's text with `{% generation %}` blocks (the
    test transformers makes)."""
    return re.search(r"\{%-?\s*generation\s*-?%\}", text) is not None


def unmark(text: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text without the generation marks, and each block's character span."""
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    at, length, start = 0, 0, None
    while at < len(text):
        nxt = min((i for i in (text.find(START, at), text.find(END, at)) if i >= 0), default=-1)
        stop = len(text) if nxt < 0 else nxt
        out.append(text[at:stop])
        length += stop - at
        if nxt < 0:
            break
        if text[nxt] == START:
            start = length
        elif start is not None:
            spans.append((start, length))
            start = None
        at = nxt + 1
    return "".join(out), [s for s in spans if s[1] > s[0]]
