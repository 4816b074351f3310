"""Mistral and Gemma out again: a plait run started from a `transformers` folder exports a
folder transformers loads with plait's logits, which plait reads back bitwise (`--format
hf`); a LoRA run on every PEFT target exports adapters `peft` loads on the transformers model
with plait's logits (`--format peft`), and a merged folder (`--format hf --merge`) with the
same logits. fp32, rtol 1e-5; tiny configs from tests/hf_models.py, nothing downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_models import WINDOWED_CONFIGS, hf_model, save  # noqa: E402
from plait.checkpoint import inspect, store  # noqa: E402
from plait.cli import main  # noqa: E402
from plait.models.hf.load import hf_source, load_config  # noqa: E402
from plait.models.init import fill_parameters  # noqa: E402
from plait.models.transformer import Transformer  # noqa: E402

RTOL, ATOL = 1e-5, 1e-5
FAMILIES = list(WINDOWED_CONFIGS)
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
RUN = ["--steps", "2", "--seq-len", "16", "--global-batch", "2", "--micro-batch", "2",
       "--eval-batches", "1", "--no-progress", "--device", "cpu", "--lr", "1e-3"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("Sliding windows in and out of plait. " * 300)
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, corpus) -> dict[str, Path]:
    """The family's folder, a full fine-tune and a LoRA run (every target) from it."""
    root = tmp_path_factory.mktemp(request.param)
    folder = save(WINDOWED_CONFIGS[request.param](), root / "base", seed=2)
    out = {"base": folder, "full": root / "full", "lora": root / "lora"}
    common = ["train", "--init-from", str(folder), "--data", str(corpus), *RUN]
    assert main([*common, "--out", str(out["full"])]) == 0
    lora = ["--lora-rank", "4", "--lora-targets", "all", "--out", str(out["lora"])]
    assert main([*common, *lora]) == 0
    return out


def _plait_logits(run: Path) -> torch.Tensor:
    model = inspect.load_model(store.complete(run)).eval()
    with torch.no_grad():
        return model(TOKENS)


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def test_export_hf_round_trips_bitwise(family, tmp_path) -> None:
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(family["full"]), "--format", "hf",
                 "--out", str(out)]) == 0  # fmt: skip
    trained = inspect.load_model(store.complete(family["full"]))
    back = Transformer(load_config(out))
    fill_parameters(back, hf_source(out, back.cfg))
    assert back.cfg == trained.cfg
    for (name, ours), (_, again) in zip(
        trained.named_parameters(), back.named_parameters(), strict=True
    ):
        assert torch.equal(ours, again), name
    ours = _plait_logits(family["full"])
    torch.testing.assert_close(_hf_logits(hf_model(out)), ours, rtol=RTOL, atol=ATOL)


def test_lora_exports_load_in_peft_and_merged(family, tmp_path) -> None:
    ours = _plait_logits(family["lora"])
    adapters, merged = tmp_path / "peft", tmp_path / "merged"
    run = str(family["lora"])
    assert main(["export", "--checkpoint", run, "--format", "peft", "--out", str(adapters)]) == 0
    base = hf_model(family["base"])
    assert not torch.allclose(_hf_logits(base), ours, atol=1e-3)  # the adapters moved it
    theirs = peft.PeftModel.from_pretrained(base, adapters).eval()
    torch.testing.assert_close(_hf_logits(theirs), ours, rtol=RTOL, atol=ATOL)
    assert main(["export", "--checkpoint", run, "--merge", "--out", str(merged)]) == 0
    torch.testing.assert_close(_hf_logits(hf_model(merged)), ours, rtol=RTOL, atol=ATOL)
