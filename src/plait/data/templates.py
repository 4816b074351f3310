"""Prompt templates: Stanford Alpaca's two, and chat templates rendered as transformers does.

Alpaca: the prompt is one of Stanford's two templates (with or without `input`), the response
is `output` followed by the EOS token (tokenized as Stanford's train.py does: instruct.py).

Chat: a tokenizer folder's chat template (chat_template.jinja, else tokenizer_config.json's
`chat_template`) or a `--chat-template FILE`, rendered in the environment `apply_chat_template`
uses (chat_env.py) with the variables it passes (messages, add_generation_prompt, tools and
documents (none), the folder's special tokens), so the text is byte for byte transformers'.
The targets are character spans of that text: the template's `{% generation %}` blocks
where it has them (as transformers' `return_assistant_tokens_mask`), else what each
assistant turn adds after the generation prompt, up to and including its end-of-turn token.
A template renders one string, so a turn is found by rendering the conversation up to it
with the generation prompt, then with it: the first must be a prefix of the second.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from plait.data.chat_env import END, START, NotProvided, environment, has_generation, unmark
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


def folder_chat_template(folder: Path) -> str | None:
    """A tokenizer folder's chat template, where transformers finds it: chat_template.jinja
    (which takes priority), else tokenizer_config.json's `chat_template` (a string, or a list
    of named templates, of which "default")."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = folder / "tokenizer_config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("chat_template")
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            value = named.get("default")
        if isinstance(value, str):
            return value
    return None


class ChatTemplate:
    """A compiled chat template with the special-token strings it may read (`specials`:
    bos_token, eos_token, ... as the tokenizer folder names them) and the tokenizer's added
    tokens (`end_tokens`: what may end a turn)."""

    def __init__(self, text: str, source: str, specials: dict[str, str] | None = None,
                 end_tokens: tuple[str, ...] = ()) -> None:  # fmt: skip
        from jinja2 import TemplateError

        self.text, self.source = text, source
        self.specials, self.end_tokens = dict(specials or {}), end_tokens
        self.generation = has_generation(text)
        try:
            self._compiled = environment().from_string(text)
        except TemplateError as e:
            raise ConfigError(f"chat template {source} does not compile: {e}") from None

    @classmethod
    def load(cls, file: str | None, folder: Path | None, specials: dict[str, str] | None = None,
             end_tokens: tuple[str, ...] = (), flag: str = "--format chat"):  # fmt: skip
        """`--chat-template FILE` if given, else the tokenizer folder's; ConfigError when
        there is none (`flag` names what asked for it)."""
        if file:
            path = Path(file)
            if not path.is_file():
                raise ConfigError(f"chat template file {file!r} does not exist")
            return cls(path.read_text(), repr(file), specials, end_tokens)
        text = folder_chat_template(folder) if folder else None
        if text is None:
            where = f"tokenizer folder {str(folder)!r}" if folder else "the byte tokenizer"
            raise ConfigError(
                f"{flag} needs a chat template: {where} has none (no chat_template in "
                "tokenizer_config.json); give one with --chat-template FILE"
            )
        return cls(text, f"of {str(folder)!r}", specials, end_tokens)

    def identity(self) -> dict[str, str]:
        return {"name": self.source, "sha256": sha256_text(self.text)}

    def _marked(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                where: str) -> str:  # fmt: skip
        """The template's output, `{% generation %}` blocks marked (chat_env.py)."""
        # transformers drops the keys whose value is None before rendering
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._compiled.render(
                messages=messages, tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self.specials,
            )  # fmt: skip
        except NotProvided as e:
            given = ", ".join(["messages", "add_generation_prompt", "tools", "documents",
                               *self.specials])  # fmt: skip
            raise ConfigError(
                f"{where}chat template {self.source} reads {e.name!r}, which plait does not "
                f"provide (it passes {given}; transformers fills other names only from extra "
                "apply_chat_template arguments)"
            ) from None
        except Exception as e:  # Jinja raises TemplateError, TypeError, SecurityError, ...
            raise ConfigError(
                f"{where}chat template {self.source} fails to render: {type(e).__name__}: {e}"
            ) from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               where: str = "") -> str:  # fmt: skip
        """The template's text for `messages`, as apply_chat_template(tokenize=False)."""
        return unmark(self._marked(messages, add_generation_prompt, where))[0]

    def spans(self, messages: list[dict[str, Any]], where: str = "") -> tuple[str, list]:
        """The rendered conversation and the character spans of its targets: the template's
        `{% generation %}` blocks where it has them, else each assistant turn's text after
        the generation prompt up to its end-of-turn token (`_turn_span`)."""
        if self.generation:
            raw = json.dumps(messages, ensure_ascii=False)
            if START in raw or END in raw:
                raise ConfigError(f"{where}holds U+FDD0 or U+FDD1, which plait marks with")
            return unmark(self._marked(messages, False, where))
        full = self.render(messages, False, where)
        spans, done = [], 0
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
            spans.append(self._turn_span(full, len(before), len(with_turn)))
            done = len(with_turn)
        return full, [s for s in spans if s[1] > s[0]]

    def _turn_span(self, full: str, start: int, end: int) -> tuple[int, int]:
        """What the model generates after the generation prompt: the turn's text up to its
        last added token when only whitespace follows it (ChatML's "\n" after
        <|im_end|>, Zephyr's after </s>: the template's, never generated, since that token
        stops generation); the whole turn's text when it ends otherwise."""
        text = full[start:end]
        kept = text.rstrip()
        if len(kept) < len(text) and any(kept.endswith(t) for t in self.end_tokens if t):
            return start, start + len(kept)
        return start, end
