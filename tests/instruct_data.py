"""Tokenizer folders and instruction files for the instruction-data tests: a small byte-level
BPE trained here (no download), saved with a tokenizer_config.json holding BOS, EOS and a chat
template, so transformers can load the same folder and be the reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}{% endfor %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TEXT = [
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request. The quick brown fox jumps over the lazy dog. def add(a, b): "
    "return a + b  # numbers and words, 0123456789, tabs\tand newlines\n" * 3,
    "Give three tips for staying healthy. Eat a balanced diet, exercise, sleep well.",
]
ROWS = [
    {"instruction": "Give three tips for staying healthy.", "input": "",
     "output": "1. Eat well.\n2. Exercise.\n3. Sleep."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Say hi", "output": " hi there"},
]  # fmt: skip
CHATS = [
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi, how are you?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "6"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
     {"role": "user", "content": "a trailing question"}],
]  # fmt: skip


def tokenizer_folder(folder: Path, template: str | None, **config: Any) -> Path:
    """A byte-level BPE (vocabulary 400) with SPECIALS, and its tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(TEXT, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": "<s>", "eos_token": "</s>"}
    if template is not None:
        settings["chat_template"] = template
    settings.update(config)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
