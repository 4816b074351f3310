"""Hugging Face folders loaded under tp2 (vocabulary padding, GQA heads and GPT-2's fused
q/k/v split over ranks), pp2 and dp2 with ZeRO-3 (shard by shard): each rank reads only its
slices, which must be exactly the single process's weights, and the parallel model's
validation loss must be `transformers`' (fp32)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_models import gpt2_config, hf_model, llama_config, save
from plait.mesh import build_mesh
from plait.models.hf.load import hf_source, load_config
from plait.models.init import canonical_name, fill_parameters
from plait.models.transformer import Transformer
from plait.parallel.tp.sharding import full_tensor, param_shard_specs
from plait.train import Trainer
from reference import corpus_for, small_config

pytest.importorskip("transformers")

VOCAB = 301  # odd: tp2 pads the vocabulary by one row
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2, accum=2), "dp2-zero3": dict(dp=2)}


def _config(folder: str, layout: dict):
    cfg = small_config("tiny-llama", micro=2, **layout)
    cfg.model, cfg.preset, cfg.train.init_from = load_config(Path(folder)), "hf", folder
    cfg.train.eval_batches = 1
    cfg.parallel.zero = 3 if layout.get("dp") == 2 else 0
    cfg.validate(check_data=False)
    return cfg


def _load(folder: str, layout: dict) -> dict:
    """This rank's share, loaded from the folder: its weights whole, the validation loss
    through the parallel model and the batches that loss was taken on."""
    cfg = _config(folder, layout)
    trainer = Trainer(
        cfg, build_mesh(cfg.parallel.layout, torch.device("cpu"), 60), corpus_for(cfg)
    )
    loss = trainer.evaluate()
    batches = [(mb.tokens, mb.targets) for mb in trainer.batches.validation(1)]
    specs = param_shard_specs(trainer.model)
    with trainer.zero.unsharded() if trainer.zero else nullcontext():
        params = {
            n: (full_tensor(p, specs[n], trainer.comm) if n in specs else p.detach()).clone()
            for n, p in trainer.model.named_parameters()
        }
    trainer.close()
    return {"loss": loss, "batches": batches, "params": params}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": save(llama_config(VOCAB), root / "llama"),
        "gpt2": save(gpt2_config(VOCAB), root / "gpt2"),
    }


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_rank_reads_its_slices(world2, folders, kind: str, layout: str) -> None:
    folder = folders[kind]
    ranks = world2.run(_load, str(folder), LAYOUTS[layout])
    single = Transformer(load_config(folder))
    fill_parameters(single, hf_source(folder, single.cfg))
    expected = dict(single.named_parameters())
    held = set()
    for r in ranks:  # a tied head on the last stage is the embedding's copy
        for name, p in r["params"].items():
            held.add(canonical_name(single.cfg, name))
            assert torch.equal(p, expected[canonical_name(single.cfg, name)].detach()), name
    assert held == set(expected)
    batches = (
        [b for r in ranks for b in r["batches"]] if layout.startswith("dp") else ranks[0]["batches"]
    )
    with torch.no_grad():
        model = hf_model(folder)
        losses = [F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()) for x, y in batches]
    for r in ranks:
        assert r["loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)
