"""Text from a trained model: KV-cached decoding on one process, greedy or sampled.

The tokenizer is anything with `encode(text) -> ids` and `decode(ids) -> text`; plait's byte
tokenizer is the default, and a Hugging Face tokenizer wrapped the same way plugs in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
) -> Tensor:
    """The `max_new_tokens` ids (n,) that follow `prompt` (s,), each position computed once.
    `vocab`: only ids below it are produced (the tokenizer's; a model's may be larger)."""
    check_length(model, prompt.numel(), max_new_tokens)
    sampling.check()
    model.eval()
    gen = torch.Generator().manual_seed(sampling.seed)
    cache = KVCache()
    device = next(model.parameters()).device
    logits = model(prompt.view(1, -1).to(device), cache=cache)[0, -1]  # (V,)
    out = []
    for i in range(max_new_tokens):
        out.append(pick(logits[:vocab], sampling, gen))
        if i + 1 < max_new_tokens:
            logits = model(out[-1].view(1, 1), cache=cache)[0, -1]  # (V,)
    return torch.stack(out)


def complete(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
) -> str:
    """The text the model writes after `prompt` (the prompt itself not included)."""
    ids = torch.as_tensor(tokenizer.encode(prompt), dtype=torch.long)
    vocab = getattr(tokenizer, "vocab_size", None)
    return tokenizer.decode(generate(model, ids, max_new_tokens, sampling, vocab).cpu())
