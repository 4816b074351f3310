"""The context-parallel parity run (no tests here): a layout with --cp trained on packed,
masked rows against one process (tests/reference.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from packed_rows import packed_corpus
from plait.build.model import build_model
from plait.comm import Comm
from plait.mesh import build_mesh
from plait.parallel.cp.packing import ContextPacking
from plait.topology import Layout
from plait.train import Trainer
from reference import assert_matches_reference, small_config
from whole_params import whole_params

CP_TAGS = ("cp_kv", "cp_kv_grad", "cp_ring_kv", "cp_ring_back", "cp_ring_home")
"""What the exchange's calls are tagged with in the comm layer's counts."""
cpu = torch.device("cpu")
PARAM_ATOL = 5e-5  # as exact_loss.py: Adam turns rounding-order differences into ~1e-6


def cp_parity(
    cp: int = 2, exchange: str = "allgather", steps: int = 10, zero: int = 0,
    sequence_parallel: bool = False, lora: int = 0, **kw,
) -> dict:  # fmt: skip
    """Train `kw` (small_config's layout) with `cp` on packed rows whose documents straddle
    the cut; loss and gradient norm every step, the parameters after `steps` and the
    validation loss must equal one process's. Returns the losses and the comm layer's cp
    traffic of the last step."""
    cfg = small_config(steps=steps, **kw)
    par = cfg.parallel
    par.cp, par.cp_exchange, cfg.memory.zero = cp, exchange, zero
    par.sequence_parallel = sequence_parallel
    if lora:
        cfg.model.lora_rank, cfg.model.lora_targets = lora, "all"
    cfg.validate()
    corpus = packed_corpus(cfg)
    mesh = build_mesh(par.layout, torch.device("cpu"), par.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus)
    results = [trainer.train_step() for _ in range(steps)]
    stats = trainer.comm.stats
    traffic = {  # what this rank sent or gathered: the ring's receives left out
        tag: stats.total(tag=tag, axis="cp")[1] - stats.total("recv", tag, "cp")[1]
        for tag in CP_TAGS
    }
    val = trainer.evaluate()
    params = whole_params(trainer)
    trainer.close()
    assert_matches_reference(cfg, corpus, results, params, val, PARAM_ATOL)
    return {"losses": [r.loss for r in results], "traffic": traffic}


def _probe_rows(cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row of 32 tokens holding documents 0, 1, 2 of 10, 12 and 10 tokens, the same row with
    document 1's first token changed, and the segments."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 32), generator=gen)
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % cfg.model.vocab_size
    segments = torch.tensor([[0] * 10 + [1] * 12 + [2] * 10])
    return tokens, changed, segments


def moved_places(exchange: str = "allgather") -> dict:
    """TRL's probe: the places of the row whose logits move when one token of document 1
    changes, with this world's cp (1 or 2), and the one-process logits they must equal."""
    cfg = small_config(preset="tiny-llama")
    mesh = build_mesh(Layout(cp=dist.get_world_size() if dist.is_initialized() else 1), cpu)
    model = build_model(cfg.model, cpu, cfg.train.seed).eval()
    model.packed_attention = "mask"
    tokens, changed, segments = _probe_rows(cfg)
    with torch.no_grad():
        whole = [model(t, segments=segments) for t in (tokens, changed)]  # (1, 32, V)
        if mesh.size("cp") == 1:
            return {"moved": _moved(*whole, torch.arange(32)), "equal": True}
        pack = ContextPacking.shard(segments, (1, 32), Comm(mesh), exchange)
        local = [model(pack.take(t), segments=pack) for t in (tokens, changed)]  # (1, 16, V)
    equal = all(torch.allclose(mine, w[0, pack.index[0]], rtol=1e-5, atol=1e-6)
                for mine, w in zip((x[0] for x in local), whole, strict=True))  # fmt: skip
    return {"moved": _moved(*local, pack.index[0]), "equal": equal}


def _moved(before: torch.Tensor, after: torch.Tensor, places: torch.Tensor) -> list[int]:
    """The row places (from `places`, the tokens' places) whose logits differ at all."""
    differs = (before[0] != after[0]).any(-1)
    return sorted(places[differs].tolist())
