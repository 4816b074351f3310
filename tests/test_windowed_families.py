"""Mistral and Gemma against `transformers` (fp32): logits, packed and padded rows, the
masked instruction loss and greedy generation with the KV cache, each with sliding windows
shorter than the rows. Tiny configs with every flag of the family set, random weights,
saved locally; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from hf_models import WINDOWED_CONFIGS, hf_model, mistral_config, save  # noqa: E402
from packed_rows import PackedRows  # noqa: E402
from plait.errors import ConfigError  # noqa: E402
from plait.models.generate import generate  # noqa: E402
from plait.models.hf.config_json import from_hf_config, hf_config  # noqa: E402
from plait.models.hf.load import hf_source, load_config  # noqa: E402
from plait.models.init import fill_parameters  # noqa: E402
from plait.models.loss import IGNORE  # noqa: E402
from plait.models.presets import get_preset  # noqa: E402
from plait.models.transformer import Transformer, count_parameters  # noqa: E402

RTOL, ATOL = 1e-5, 1e-5
VOCAB, SEQ = 300, 24
CONFIGS = WINDOWED_CONFIGS
FAMILIES = list(CONFIGS)
# Published parameter counts (the model cards), equal to transformers' own count on meta.
PUBLISHED = {
    "mistral-7b-v0.3": 7_248_023_552,
    "gemma2-2b": 2_614_341_888,
    "gemma3-1b": 999_885_952,
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    return {name: save(make(), root / name, seed=3) for name, make in CONFIGS.items()}


def plait_from(folder: Path) -> Transformer:
    cfg = load_config(folder)
    model = Transformer(cfg)
    fill_parameters(model, hf_source(folder, cfg))
    return model.eval()


@pytest.fixture(scope="module")
def models(folders) -> dict[str, tuple[Transformer, torch.nn.Module]]:
    return {name: (plait_from(folder), hf_model(folder)) for name, folder in folders.items()}


def _tokens(rows: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_logits_equal_transformers(models, family: str) -> None:
    ours, theirs = models[family]
    assert ours.cfg.arch == family
    tokens = _tokens()
    torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_packed_rows_give_each_document_its_logits_and_loss(models, family) -> None:
    """Packed rows (prompts IGNORE, a padding run) under each CPU packed-attention mode
    (the mask, per document): every document's logits are transformers' on the document
    alone, and the masked loss is the mean of transformers' per-token losses over the
    targets."""
    ours, theirs = models[family]
    rows = PackedRows(3, SEQ, VOCAB, seed=5)
    docs, total, count = [], torch.zeros(()), 0
    for r in range(len(rows)):
        for seg in rows.segments[r].unique():
            at = (rows.segments[r] == seg).nonzero().squeeze(1)
            ref = theirs(rows.tokens[r, at][None]).logits[0]  # (l, V)
            docs.append((r, at, ref))
            total += F.cross_entropy(ref, rows.targets[r, at], ignore_index=IGNORE, reduction="sum")
            count += int((rows.targets[r, at] != IGNORE).sum())
    assert len(docs) > len(rows)  # rows of several documents
    for mode in ("mask", "per-document"):
        ours.packed_attention = mode
        try:
            logits = ours(rows.tokens, segments=rows.segments)
            loss = ours(rows.tokens, rows.targets, segments=rows.segments)
        finally:
            ours.packed_attention = "auto"
        for r, at, ref in docs:
            torch.testing.assert_close(logits[r, at], ref, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(loss, total / count, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_right_padded_rows_equal_transformers_with_an_attention_mask(models, family) -> None:
    ours, theirs = models[family]
    tokens, lengths = _tokens(), (SEQ, 15)
    keep = torch.arange(SEQ) < torch.tensor(lengths)[:, None]  # (b, s)
    segments = (~keep).long()  # the padding: a run of its own
    mine = ours(tokens, segments=segments)
    ref = theirs(tokens, attention_mask=keep.long()).logits
    torch.testing.assert_close(mine[keep], ref[keep], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_with_the_cache_gives_transformers_tokens(models, family) -> None:
    """A prompt shorter than the window, and 14 new tokens: the cache slides past it."""
    ours, theirs = models[family]
    prompt = _tokens(1, 3)[0]
    mine = generate(ours, prompt, 14)
    ref = theirs.generate(prompt[None], max_new_tokens=14, do_sample=False, min_new_tokens=14)
    assert mine.tolist() == ref[0, 3:].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_config_round_trips(folders, family: str) -> None:
    cfg = load_config(folders[family])
    again = from_hf_config(hf_config(cfg))
    assert again == cfg


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_counts(name: str) -> None:
    cfg = get_preset(name)
    hf = transformers.AutoConfig.for_model(**hf_config(cfg))
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(hf)
    assert count_parameters(cfg) == theirs.num_parameters() == PUBLISHED[name]


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"sliding_window": 0}, "model.sliding_window must be >= 1, got 0"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' cannot be expressed"),
    ],
)
def test_what_mistral_cannot_express_is_named(over: dict, message: str) -> None:
    hf = mistral_config().to_dict() | over
    with pytest.raises(ConfigError, match=message):
        from_hf_config(hf)
