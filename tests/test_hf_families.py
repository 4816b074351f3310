"""Each Llama-like family (tests/hf_models.py FAMILY_CONFIGS: every flag of the family set)
loaded from a `transformers` folder computes transformers' logits and masked loss in fp32,
on packed rows with a padding run (each document against transformers run on it alone), and
greedy generation with plait's KV cache gives transformers' tokens."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from hf_models import FAMILY_CONFIGS, hf_model, save  # noqa: E402
from plait.models.generate import generate  # noqa: E402
from plait.models.hf.load import hf_source, load_config  # noqa: E402
from plait.models.init import fill_parameters  # noqa: E402
from plait.models.loss import IGNORE  # noqa: E402
from plait.models.transformer import Transformer  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
VOCAB = 300
FAMILIES = list(FAMILY_CONFIGS)
GEN = torch.Generator().manual_seed(3)
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=GEN)
RUNS = [(0, 9), (9, 20), (20, 24)]  # two documents, then a padding run (no targets)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {kind: save(make(VOCAB), root / kind) for kind, make in FAMILY_CONFIGS.items()}


def plait_from(folder: Path) -> Transformer:
    cfg = load_config(folder)
    model = Transformer(cfg)
    fill_parameters(model, hf_source(folder, cfg))
    return model.eval()


def _targets() -> torch.Tensor:
    """Next tokens, a prompt of each document and the padding run ignored."""
    targets = torch.randint(0, VOCAB, TOKENS.shape, generator=torch.Generator().manual_seed(4))
    targets[:, 0:4] = IGNORE
    targets[:, 9:13] = IGNORE
    targets[:, 20:] = IGNORE
    return targets


@pytest.mark.parametrize("kind", FAMILIES)
@torch.no_grad()
def test_logits_and_loss_equal_transformers(folders, kind: str) -> None:
    ours, theirs = plait_from(folders[kind]), hf_model(folders[kind])
    torch.testing.assert_close(ours(TOKENS), theirs(TOKENS).logits, rtol=RTOL, atol=ATOL)
    segments = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(RUNS)])
    segments = segments.expand_as(TOKENS).contiguous()
    packed = ours(TOKENS, segments=segments)
    alone = torch.cat([theirs(TOKENS[:, a:b]).logits for a, b in RUNS], dim=1)
    torch.testing.assert_close(packed, alone, rtol=RTOL, atol=ATOL)
    targets = _targets()
    loss = ours(TOKENS, targets, segments=segments)
    expected = F.cross_entropy(alone.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("kind", FAMILIES)
@torch.no_grad()
def test_greedy_generation_with_the_cache_gives_transformers_tokens(folders, kind) -> None:
    prompt = TOKENS[0, :7]
    ours = generate(plait_from(folders[kind]), prompt, 12)
    theirs = hf_model(folders[kind]).generate(
        prompt.view(1, -1), max_new_tokens=12, do_sample=False, eos_token_id=None
    )
    assert ours.tolist() == theirs[0, 7:].tolist()


def test_the_family_fields_map(folders) -> None:
    llama3, qwen3 = load_config(folders["llama3"]), load_config(folders["qwen3"])
    assert (llama3.arch, llama3.rope_theta, llama3.rope_factor, llama3.rope_original_max) == (
        "llama", 500000.0, 8.0, 16,
    )  # fmt: skip
    assert (qwen3.arch, qwen3.head_dim, qwen3.tie_embeddings) == ("qwen3", 24, True)
    assert (load_config(folders["qwen2"]).arch, load_config(folders["phi3"]).arch) == (
        "qwen2", "phi3",
    )  # fmt: skip


LONGROPE = {"type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}


@pytest.mark.parametrize(
    ("kind", "over", "message"),
    [
        ("phi3", {"rope_scaling": LONGROPE}, "rope_scaling.rope_type='longrope' cannot be "
         "expressed by plait's model (plain RoPE or llama3 only)"),
        ("phi3", {"sliding_window": 2047}, "sliding_window=2047 cannot be expressed"),
        ("phi3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 cannot be"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True cannot be expressed"),
        ("qwen3", {"attention_bias": True}, "attention_bias=True cannot be expressed"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act='gelu' cannot be expressed"),
        ("qwen3", {"model_type": "mamba"}, "model_type='mamba' is not one plait reads (llama, "
         "qwen2, qwen3, phi3, gpt2, mistral, gemma2, gemma3_text)"),
    ],
)  # fmt: skip
def test_what_a_family_cannot_express_is_named(kind: str, over: dict, message: str) -> None:
    from plait.errors import ConfigError
    from plait.models.hf.config_json import from_hf_config

    hf = FAMILY_CONFIGS[kind](VOCAB).to_dict() | over
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_hf_config(hf)
