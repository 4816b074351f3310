"""Hugging Face folders loaded under tp2 (vocabulary padding, GQA heads and GPT-2's fused
q/k/v split over ranks), pp2 and dp2 with ZeRO-3 (shard by shard): each rank reads only its
slices, which must be exactly the single process's weights, and the parallel model's
logits and validation loss must be `transformers`' (fp32, rtol 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_models import FAMILY_CONFIGS, WINDOWED_CONFIGS, gpt2_config, hf_model, llama_config, save
from plait.mesh import build_mesh
from plait.models.hf.load import hf_source, load_config
from plait.models.init import canonical_name, fill_parameters
from plait.models.transformer import Transformer
from plait.parallel.pipeline.stage import run_stage
from plait.parallel.tp.sharding import full_tensor, split_spec
from plait.train import Trainer
from reference import corpus_for, small_config
from whole_params import whole_params

pytest.importorskip("transformers")

VOCAB = 301  # odd: tp2 pads the vocabulary by one row
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
FAMILIES = FAMILY_CONFIGS | WINDOWED_CONFIGS
LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2, accum=2),
    "dp2-zero3": dict(dp=2),
}


def _config(folder: str, layout: dict):
    shape = {k: v for k, v in layout.items() if k != "sp"}
    cfg = small_config("tiny-llama", micro=2, **shape)
    cfg.model, cfg.preset, cfg.checkpoint.init_from = load_config(Path(folder)), "hf", folder
    cfg.train.eval_batches = 1
    cfg.memory.zero = 3 if layout.get("dp") == 2 else 0
    cfg.parallel.sequence_parallel = layout.get("sp", False)
    cfg.validate()
    return cfg


@torch.no_grad()
def _logits(trainer: Trainer, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits of the parallel model (tp: the vocabulary slices gathered; pp: stage 0's
    activations handed to stage 1); None on a rank that has none (pp stage 0)."""
    model, comm = trainer.model.eval(), trainer.comm
    if trainer.pipeline is None:
        local = model(tokens)  # (b, s, V/tp), padding included
        if comm.mesh.size("tp") == 1:
            return local
        spec = split_spec((*local.shape[:2], VOCAB), 2, comm.mesh.axis_rank("tp"), 2, pad=True)
        return full_tensor(local, spec, comm)
    plan = trainer.pipeline.plans[0]
    x = torch.empty(*tokens.shape, model.cfg.d_model)
    if plan.first:
        x = run_stage(model, plan, tokens, None)
    dist.broadcast(x, src=0)  # the test's own hand-over; pp2 is the whole world
    return None if plan.first else run_stage(model, plan, x, None)


def _load(folder: str, layout: dict, tokens: torch.Tensor) -> dict:
    """This rank's share, loaded from the folder: its weights whole, the logits and the
    validation loss through the parallel model, the batches that loss was taken on."""
    cfg = _config(folder, layout)
    trainer = Trainer(
        cfg, build_mesh(cfg.parallel.layout, torch.device("cpu"), 60), corpus_for(cfg)
    )
    logits = _logits(trainer, tokens) if not layout.get("dp") else None
    loss = trainer.evaluate()
    batches = [(mb.tokens, mb.targets) for mb in trainer.batches.validation(1)]
    params = whole_params(trainer)
    trainer.close()
    return {"loss": loss, "batches": batches, "params": params, "logits": logits}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": save(llama_config(VOCAB), root / "llama"),
        "gpt2": save(gpt2_config(VOCAB), root / "gpt2"),
    } | {kind: save(make(VOCAB), root / kind) for kind, make in FAMILIES.items()}


CASES = [(kind, layout) for kind in ("llama", "gpt2") for layout in LAYOUTS if layout != "tp2-sp"]
CASES += [(kind, layout) for kind in FAMILIES for layout in LAYOUTS if layout != "tp2"]


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_each_rank_reads_its_slices(world2, folders, kind: str, layout: str) -> None:
    folder = folders[kind]
    ranks = world2.run(_load, str(folder), LAYOUTS[layout], TOKENS)
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
        theirs = model(TOKENS).logits
        compared = [r for r in ranks if r["logits"] is not None]
        assert compared or layout.startswith("dp")  # tp2: both ranks; pp2: the last stage
        for r in compared:
            atol = 1e-5 if kind == "gemma2" else 1e-6  # its logits reach the cap (3)
            torch.testing.assert_close(r["logits"], theirs, rtol=1e-5, atol=atol)
        losses = [F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()) for x, y in batches]
    for r in ranks:
        assert r["loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)
