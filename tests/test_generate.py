"""KV-cached decoding: the cached forward computes exactly the full forward's logits, and
generation is greedy or seeded sampling over them."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from plait.data.corpus import ByteTokenizer
from plait.errors import ConfigError
from plait.models.generate import Sampling, complete, generate
from plait.models.init import init_parameters
from plait.models.kv_cache import KVCache
from plait.models.presets import get_preset
from plait.models.transformer import Transformer


def _model(preset: str, **over) -> Transformer:
    cfg = get_preset(preset)
    for key, value in over.items():
        setattr(cfg, key, value)
    model = Transformer(cfg)
    init_parameters(model, seed=3)
    return model.eval()


@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-llama"])
@torch.no_grad()
def test_cached_logits_equal_the_full_forward(preset: str) -> None:
    model = _model(preset, init_std=0.2)  # larger weights: attention far from uniform
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    full = model(tokens)  # (b, s, V)
    cache = KVCache()
    pieces = [model(tokens[:, :7], cache=cache)]  # a prompt, then chunks of 1 and 4
    pieces += [model(tokens[:, i : i + 1], cache=cache) for i in range(7, 12)]
    pieces += [model(tokens[:, i : i + 4], cache=cache) for i in range(12, 24, 4)]
    assert cache.length == 24
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_greedy_generation_is_the_argmax_of_the_full_forward() -> None:
    model = _model("tiny-llama", init_std=0.2)
    prompt = torch.tensor([10, 20, 30, 40])
    out = generate(model, prompt, 12)
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(12):  # no cache: recompute everything each token
            seq = torch.cat([seq, model(seq[None])[0, -1].argmax().view(1)])
    assert torch.equal(out, seq[4:])


def test_sampling_is_seeded_and_top_k_1_is_greedy() -> None:
    model = _model("tiny-gpt", init_std=0.2)
    prompt = torch.tensor([1, 2, 3])
    hot = Sampling(temperature=1.5, seed=7)
    first, again = generate(model, prompt, 20, hot), generate(model, prompt, 20, hot)
    assert torch.equal(first, again)
    assert not torch.equal(first, generate(model, prompt, 20, Sampling(1.5, seed=8)))
    assert torch.equal(
        generate(model, prompt, 20, Sampling(1.5, 1, 9)), generate(model, prompt, 20)
    )


def test_only_ids_the_tokenizer_knows_are_written() -> None:
    model = _model("tiny-gpt", vocab_size=300, init_std=0.5)
    text = complete(model, ByteTokenizer(), "abc", 30, Sampling(temperature=5.0, seed=1))
    assert isinstance(text, str)  # the byte tokenizer raises on an id above 255


@pytest.mark.parametrize(
    ("prompt", "n", "sampling", "message"),
    [
        ([], 4, Sampling(), "the prompt is empty"),
        ([1], 0, Sampling(), "--max-new-tokens must be >= 1, got 0"),
        ([1] * 60, 5, Sampling(), "prompt (60 tokens) + --max-new-tokens 5 exceeds"),
        ([1], 4, Sampling(temperature=-1), "--temperature must be >= 0, got -1"),
        ([1], 4, Sampling(top_k=-2), "--top-k must be >= 0"),
    ],
)
def test_bad_generation_requests_are_named(prompt, n, sampling, message) -> None:
    model = _model("tiny-gpt")  # learned positions, max_seq_len 64
    with pytest.raises(ConfigError, match=re.escape(message)):
        generate(model, torch.tensor(prompt, dtype=torch.long), n, sampling)


# A piped `plait generate` whose model "writes" TEXT: the model is a fresh tiny Llama and
# the decoding loop yields TEXT's byte ids, so everything from the ids on (the tokenizer's
# decode, the printing) is the command's own.
PIPED = """
import sys, torch
import plait.cli.models as cli_models, plait.models.generate as gen
from plait.cli import main
from plait.data.tokenizer import BYTES
from plait.models.presets import get_preset
from plait.models.transformer import Transformer
ids = torch.tensor(list(sys.stdin.buffer.read()))
cli_models.load_generator = lambda args: Transformer(get_preset("tiny-llama"))
cli_models.generator_tokenizer = lambda args: BYTES
gen.generate = lambda model, prompt, n, sampling, vocab, stop: ids
sys.exit(main(["generate", "--init-from", "unused", "--prompt", "Say: "]))
"""


def test_generate_prints_the_decoded_text_byte_for_byte_when_piped() -> None:
    """rich printed it hard-wrapped at 80 columns (the space at the break lost), with
    `:thumbs_up:` as an emoji and the control characters dropped."""
    text = "ok " * 60 + "\n:thumbs_up: [bold]x[/bold] \x07bell \x1b[31mred\ttab é €\n  end "
    done = subprocess.run(
        [sys.executable, "-c", PIPED], input=text.encode(), capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == ("Say: " + text + "\n").encode()
