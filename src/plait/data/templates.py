"""Prompt templates: Stanford Alpaca's two, and chat templates rendered as transformers does.

Alpaca: the prompt is one of Stanford's two templates (with or without `input`), the response
is `output`; the EOS id goes after it when the example is tokenized (instruct.py).

Chat: a tokenizer folder's `chat_template` (tokenizer_config.json, or chat_template.jinja
beside it) or a `--chat-template FILE`, rendered in Jinja's immutable sandbox with the
environment `apply_chat_template` uses (trim_blocks, lstrip_blocks, loop controls, its
`tojson` and `raise_exception`), so the text is byte for byte what transformers renders.
Only assistant turns are targets. A template renders one string, so the turns are found by
rendering the conversation up to each assistant turn with the generation prompt, then with
the turn: the first must be a prefix of the second, and the difference is the turn's text.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.errors import ConfigError

# Stanford Alpaca's train.py, PROMPT_DICT, exactly.
ALPACA_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)


def alpaca_prompt(instruction: str, input: str | None) -> str:
    """Stanford's prompt: the input template when `input` is a non-empty string."""
    if input:
        return ALPACA_INPUT.format_map({"instruction": instruction, "input": input})
    return ALPACA_NO_INPUT.format_map({"instruction": instruction})


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def alpaca_identity() -> dict[str, str]:
    """The template record of an index: its name and the SHA-256 of both templates."""
    return {"name": "alpaca", "sha256": sha256_text(ALPACA_INPUT + "\n" + ALPACA_NO_INPUT)}


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' override: Jinja's own tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def folder_chat_template(folder: Path) -> str | None:
    """A tokenizer folder's chat template: tokenizer_config.json's `chat_template` (a string,
    or a list of named templates, of which "default"), else chat_template.jinja."""
    config = folder / "tokenizer_config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("chat_template")
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            value = named.get("default")
        if isinstance(value, str):
            return value
    jinja = folder / "chat_template.jinja"
    return jinja.read_text() if jinja.is_file() else None


@dataclass(frozen=True)
class Turn:
    """A piece of rendered text and whether its tokens are targets."""

    text: str
    target: bool


class ChatTemplate:
    """A compiled chat template with the special-token strings it may use."""

    def __init__(self, text: str, source: str, bos: str | None, eos: str | None) -> None:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.text, self.source, self.bos, self.eos = text, source, bos, eos
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        try:
            self._compiled = env.from_string(text)
        except TemplateError as e:
            raise ConfigError(f"chat template {source} does not compile: {e}") from None

    @classmethod
    def load(cls, file: str | None, folder: Path | None, bos: str | None, eos: str | None,
             flag: str = "--format chat"):  # fmt: skip
        """`--chat-template FILE` if given, else the tokenizer folder's; ConfigError when
        there is none (`flag` names what asked for it)."""
        if file:
            path = Path(file)
            if not path.is_file():
                raise ConfigError(f"chat template file {file!r} does not exist")
            return cls(path.read_text(), repr(file), bos, eos)
        text = folder_chat_template(folder) if folder else None
        if text is None:
            where = f"tokenizer folder {str(folder)!r}" if folder else "the byte tokenizer"
            raise ConfigError(
                f"{flag} needs a chat template: {where} has none (no chat_template in "
                "tokenizer_config.json); give one with --chat-template FILE"
            )
        return cls(text, f"of {str(folder)!r}", bos, eos)

    def identity(self) -> dict[str, str]:
        return {"name": self.source, "sha256": sha256_text(self.text)}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               where: str = "") -> str:  # fmt: skip
        """The template's text for `messages`, as apply_chat_template(tokenize=False)."""
        try:
            return self._compiled.render(
                messages=messages,
                bos_token=self.bos or "",
                eos_token=self.eos or "",
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # Jinja raises TemplateError, TypeError, SecurityError, ...
            raise ConfigError(
                f"{where}chat template {self.source} fails to render: {type(e).__name__}: {e}"
            ) from None

    def turns(self, messages: list[dict[str, Any]], where: str = "") -> list[Turn]:
        """The rendered conversation cut into pieces: each assistant turn's text a target,
        the text between them not. ConfigError when the template does not render the
        conversation up to a turn as a prefix of the conversation with it."""
        full = self.render(messages, False, where)
        pieces: list[Turn] = []
        done = 0  # characters of `full` already in pieces
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], True, where)
            with_turn = self.render(messages[: i + 1], False, where)
            if not (with_turn.startswith(before) and full.startswith(with_turn)
                    and len(before) >= done):  # fmt: skip
                raise ConfigError(
                    f"{where}chat template {self.source} does not render the conversation up "
                    f"to message {i} with the generation prompt as a prefix of the "
                    "conversation with it, so the assistant's text cannot be told apart"
                )
            pieces.append(Turn(full[done : len(before)], False))
            pieces.append(Turn(full[len(before) : len(with_turn)], True))
            done = len(with_turn)
        pieces.append(Turn(full[done:], False))
        return [p for p in pieces if p.text]
