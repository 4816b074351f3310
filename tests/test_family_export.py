"""Each Llama-like family out again (fp32): a folder read into plait and written back is the
same tensors bit for bit; a fine-tuned run exported with `plait export --format hf` loads in
transformers with plait's logits; a LoRA run (every Linear of the block, under the family's
PEFT names: Phi-3's qkv_proj and gate_up_proj adapted once each) exports adapters PEFT loads
with plait's logits, and `--format hf --merge` a plain folder with the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_models import FAMILY_CONFIGS, hf_model, save  # noqa: E402
from plait.checkpoint import inspect, store  # noqa: E402
from plait.cli import main  # noqa: E402
from plait.models.hf.export import write_folder  # noqa: E402
from plait.models.hf.load import hf_source, load_config  # noqa: E402
from plait.models.init import fill_parameters, with_adapters  # noqa: E402
from plait.models.transformer import Transformer  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
VOCAB = 300
FAMILIES = list(FAMILY_CONFIGS)
TOKENS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
RUN = ["--steps", "1", "--seq-len", "16", "--global-batch", "2", "--micro-batch", "1",
       "--eval-batches", "1", "--no-progress", "--device", "cpu", "--lr", "1e-2"]  # fmt: skip
PEFT_MODULES = {
    "phi3": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"],
    "other": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families-out")
    return {kind: save(make(VOCAB), root / kind) for kind, make in FAMILY_CONFIGS.items()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("Families in and out of plait, as transformers writes them. " * 40)
    return path


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model.eval()(TOKENS)
    return out if isinstance(out, torch.Tensor) else out.logits


def _checkpoint_logits(base: Path, run: Path) -> torch.Tensor:
    """What plait computes for a run's checkpoint (a LoRA one: the base and its adapters)."""
    checkpoint = store.complete(run)
    cfg, masters = inspect.model_config(checkpoint), inspect.read_masters(checkpoint)
    model = Transformer(cfg)
    source = hf_source(base, cfg)
    if cfg.lora is not None:
        source = with_adapters(source, cfg, 0, lambda name, shape, shard: masters[name])
    else:
        source = lambda name, shape, shard: masters[name]  # noqa: E731
    fill_parameters(model, source)
    return _logits(model)


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_folder_written_back_is_bitwise_the_same(folders, tmp_path, kind: str) -> None:
    cfg = load_config(folders[kind])
    model = Transformer(cfg)
    fill_parameters(model, hf_source(folders[kind], cfg))
    params = {n: p.detach() for n, p in model.named_parameters()}
    write_folder(cfg, params, tmp_path / "out")
    theirs = load_file(str(folders[kind] / "model.safetensors"))
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert load_config(tmp_path / "out") == cfg


@pytest.mark.parametrize("kind", ["phi3"])  # the others write through the same write_folder
def test_export_hf_loads_in_transformers(folders, corpus, tmp_path, kind: str) -> None:
    run = tmp_path / "run"
    assert main(["train", "--init-from", str(folders[kind]), "--data", str(corpus),
                 "--out", str(run), *RUN]) == 0  # fmt: skip
    assert main(["export", "--checkpoint", str(run), "--format", "hf",
                 "--out", str(tmp_path / "hf")]) == 0  # fmt: skip
    ours = _checkpoint_logits(folders[kind], run)
    assert not torch.allclose(ours, _logits(hf_model(folders[kind])), rtol=1e-3)  # it trained
    torch.testing.assert_close(_logits(hf_model(tmp_path / "hf")), ours, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", FAMILIES)
def test_export_peft_and_merged(folders, corpus, tmp_path, kind: str) -> None:
    run = tmp_path / "run"
    lora = ["--lora-rank", "4", "--lora-targets", "all"]
    assert main(["train", "--init-from", str(folders[kind]), "--data", str(corpus),
                 "--out", str(run), *RUN, *lora]) == 0  # fmt: skip
    out = {fmt: tmp_path / fmt for fmt in ("peft", "merged")}
    assert main(["export", "--checkpoint", str(run), "--format", "peft",
                 "--out", str(out["peft"])]) == 0  # fmt: skip
    assert main(["export", "--checkpoint", str(run), "--format", "hf", "--merge",
                 "--out", str(out["merged"])]) == 0  # fmt: skip
    config = peft.PeftConfig.from_pretrained(out["peft"])
    assert sorted(config.target_modules) == PEFT_MODULES.get(kind, PEFT_MODULES["other"])
    ours = _checkpoint_logits(folders[kind], run)
    theirs = peft.PeftModel.from_pretrained(hf_model(folders[kind]), out["peft"])
    torch.testing.assert_close(_logits(theirs), ours, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(_logits(hf_model(out["merged"])), ours, rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("kind", FAMILIES)
def test_plait_reads_what_peft_saves(folders, tmp_path, kind: str) -> None:
    """PEFT's adapter on every Linear of the family's block (its own module names), random
    A and B, saved by PEFT: plait reads its fields and tensors and computes PEFT's logits."""
    from plait.models.hf.peft import adapter_model_fields, adapter_source, read_adapter_config

    names = PEFT_MODULES.get(kind, PEFT_MODULES["other"])
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=names, task_type="CAUSAL_LM")
    theirs = peft.get_peft_model(hf_model(folders[kind]), config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in theirs.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    theirs.save_pretrained(tmp_path / "adapter")
    cfg = load_config(folders[kind])
    fields = adapter_model_fields(read_adapter_config(tmp_path / "adapter"), cfg)
    assert fields["lora_targets"] == "q,k,v,o,gate,up,down"
    for key, value in fields.items():
        setattr(cfg, key, value)
    model = Transformer(cfg)
    adapters = adapter_source(tmp_path / "adapter", cfg)
    fill_parameters(model, with_adapters(hf_source(folders[kind], cfg), cfg, 0, adapters))
    torch.testing.assert_close(_logits(model), _logits(theirs), rtol=RTOL, atol=ATOL)
