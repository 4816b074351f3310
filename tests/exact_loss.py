"""The exact-loss parity run (no tests here): a layout trained on packed, masked rows
against one process (tests/reference.py), or 2BW against its delayed single-process rule."""

from __future__ import annotations

import torch

from packed_rows import packed_corpus
from plait.build.corpus import load_corpus
from plait.mesh import build_mesh
from plait.train import Trainer
from reference import assert_matches_reference, small_config
from test_pp_2bw import delayed_reference, two_bw_config
from whole_params import whole_params

RTOL = 1e-5
PARAM_ATOL = 5e-5  # as test_pp_parity.py: Adam amplifies rounding-order differences


def exact_parity(
    steps: int = 4,
    zero: int = 0,
    offload: str = "none",
    sequence_parallel: bool = False,
    dp_mode: str = "ddp",
    examples: str | None = None,
    **kw,
) -> list[float]:
    """Train the layout `kw` (small_config's arguments; schedule '2bw' too) on packed rows
    (tests/packed_rows.py, or the prepared `examples` folder as `plait train` reads it, its
    tokenizer's 400 tokens and rows of 128); loss and gradient norm every step, final
    parameters and the validation loss must equal the single process's. Returns the step
    losses."""
    two_bw = kw.get("schedule") == "2bw"
    if two_bw:
        cfg = two_bw_config(steps=steps, **{k: v for k, v in kw.items() if k != "schedule"})
    else:
        cfg = small_config(steps=steps, **kw)
    par = cfg.parallel
    cfg.memory.zero, cfg.memory.offload, par.dp_mode = zero, offload, dp_mode
    par.sequence_parallel = sequence_parallel
    if examples is not None:
        cfg.data.path, cfg.model.vocab_size = examples, 400
        cfg.train.seq_len = cfg.model.max_seq_len = 128  # two or three examples a row
    if not two_bw:
        cfg.validate()
    corpus = packed_corpus(cfg) if examples is None else load_corpus(cfg)
    mesh = build_mesh(par.layout, torch.device("cpu"), par.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus)
    results = [trainer.train_step() for _ in range(steps)]
    val = trainer.evaluate()
    params = whole_params(trainer)
    trainer.close()
    if not two_bw:
        assert_matches_reference(cfg, corpus, results, params, val, PARAM_ATOL)
        return [r.loss for r in results]
    losses, norms, ref_params, ref_val = delayed_reference(cfg, corpus, steps)
    torch.testing.assert_close(torch.tensor([r.loss for r in results]), torch.tensor(losses),
                               rtol=RTOL, atol=0)  # fmt: skip
    torch.testing.assert_close(torch.tensor([r.grad_norm for r in results]),
                               torch.tensor(norms), rtol=RTOL, atol=0)  # fmt: skip
    tied = cfg.model.tie_embeddings
    for name, p in params.items():
        ref = ref_params["embed.tok.weight" if tied and name == "head.weight" else name]
        torch.testing.assert_close(p, ref, rtol=RTOL, atol=PARAM_ATOL, msg=lambda m, n=name: n + m)
    assert abs(val - ref_val) <= RTOL * abs(ref_val), (val, ref_val)
    return [r.loss for r in results]
