"""Text from a trained model: KV-cached decoding on one process, greedy or sampled.

The tokenizer is anything with `encode(text) -> ids` and `decode(ids) -> text`; plait's byte
tokenizer is the default, and a Hugging Face tokenizer wrapped the same way plugs in.
Decoding stops early at a stop id (the end of a response): `stop_ids` says which, by
transformers' rule for a model folder.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from plait.errors import ConfigError
from plait.models.kv_cache import KVCache
from plait.models.transformer import Transformer


class Tokenizer(Protocol):
    def encode(self, text: str) -> Any: ...
    def decode(self, ids: Sequence[int] | Tensor) -> str: ...


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (the most likely token); else softmax(logits / temperature)
    over the `top_k` most likely tokens (0: all), drawn from a generator seeded by `seed`."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def check(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0: all tokens), got {self.top_k}")


def pick(logits: Tensor, sampling: Sampling, gen: torch.Generator) -> Tensor:
    """The next token id (a 0-d tensor) from one position's logits (V,)."""
    if sampling.temperature == 0:
        return logits.argmax()
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = logits.topk(sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1).cpu(), 1, generator=gen)[0].to(logits.device)


def check_length(model: Transformer, prompt_len: int, max_new_tokens: int) -> None:
    """Learned positions end at max_seq_len; RoPE has no end."""
    if prompt_len < 1:
        raise ConfigError("the prompt is empty: generation needs at least one token")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    cfg = model.cfg
    if cfg.pos == "learned" and prompt_len + max_new_tokens > cfg.max_seq_len:
        raise ConfigError(
            f"prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
            f"model's max_seq_len {cfg.max_seq_len} (learned positions)"
        )


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    vocab: int | None = None,
    stop: Sequence[int] = (),
) -> Tensor:
    """The ids (n,) that follow `prompt` (s,), each position computed once: `max_new_tokens`
    of them, or fewer when one of `stop` comes first (that id itself not returned).
    `vocab`: only ids below it are produced (the tokenizer's; a model's may be larger)."""
    check_length(model, prompt.numel(), max_new_tokens)
    sampling.check()
    model.eval()
    gen = torch.Generator().manual_seed(sampling.seed)
    cache = KVCache()
    device = next(model.parameters()).device
    logits = model(prompt.view(1, -1).to(device), cache=cache)[0, -1]  # (V,)
    out: list[Tensor] = []
    stops = frozenset(int(i) for i in stop)
    for i in range(max_new_tokens):
        token = pick(logits[:vocab], sampling, gen)
        if int(token) in stops:
            break
        out.append(token)
        if i + 1 < max_new_tokens:
            logits = model(token.view(1, 1), cache=cache)[0, -1]  # (V,)
    return torch.stack(out) if out else torch.empty(0, dtype=torch.long)


def stop_ids(eos_id: int, folder: str | Path | None = None) -> list[int]:
    """The ids that end a response: a model folder's generation_config.json `eos_token_id`
    (an id or a list: chat models list their end-of-turn token there, as transformers'
    `generate` reads it) when the folder has one, else the tokenizer's end-of-sequence id."""
    config = Path(folder) / "generation_config.json" if folder else None
    if config is not None and config.is_file():
        value = json.loads(config.read_text()).get("eos_token_id")
        ids = value if isinstance(value, list) else [value]
        if ids and all(isinstance(i, int) for i in ids):
            return list(ids)
    return [eos_id]


def complete(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int] | Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop: Sequence[int] = (),
) -> str:
    """The text the model writes after `prompt` (the prompt itself not included): a string
    encoded by `tokenizer`, or ids already built (a template's prompt, `data.instruct`)."""
    ids = prompt if not isinstance(prompt, str) else tokenizer.encode(prompt)
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    vocab = getattr(tokenizer, "vocab_size", None)
    return tokenizer.decode(generate(model, ids, max_new_tokens, sampling, vocab, stop).cpu())
