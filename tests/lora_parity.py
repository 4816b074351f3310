"""LoRA in a parallel layout against one process (no tests here): tests/test_lora_layouts.py
and tests/test_lora_pipelines.py run `lora_parity` on every rank of a harness world.

A layout's losses and gradient norms every step (fp32, rtol 1e-5), its validation loss and
every parameter after the run (tp shards gathered) must equal the single-process loop of
tests/reference.py, or for 2BW the delayed single-process rule of tests/test_pp_2bw.py. On
top of that, what "frozen" promises is measured on each rank: the base has requires_grad
False, never a `.grad`, never changes (bitwise), and the optimizer states and gradient
buckets hold the adapters' bytes and nothing else.
"""

from __future__ import annotations

import torch

from plait.config import Config, ParallelConfig
from plait.mesh import build_mesh
from plait.models.declare import is_adapter
from plait.train import Trainer
from reference import assert_matches_reference, corpus_for, small_config
from test_pp_2bw import delayed_reference, two_bw_config
from whole_params import whole_params

RTOL = 1e-5
PARAM_ATOL = 5e-5  # as test_pp_parity.py: Adam turns rounding-order differences into ~1e-6
RANK = 4


def lora_config(
    steps: int = 4,
    targets: str = "all",
    lora_dropout: float = 0.0,
    sequence_parallel: bool = False,
    dp_mode: str = "ddp",
    zero: int = 0,
    **kw,
) -> Config:
    """small_config (or 2BW's) with rank-4 adapters on `targets`, at the default bucket size
    (one bucket of tiny adapters: the shape a real LoRA run's buckets take)."""
    kw.setdefault("bucket_mb", ParallelConfig().bucket_mb)
    two_bw = kw.get("schedule") == "2bw"
    if two_bw:
        cfg = two_bw_config(steps=steps, **{k: v for k, v in kw.items() if k != "schedule"})
    else:
        cfg = small_config(steps=steps, **kw)
    m = cfg.model
    m.lora_rank, m.lora_targets, m.lora_dropout = RANK, targets, lora_dropout
    cfg.parallel.sequence_parallel, cfg.parallel.dp_mode = sequence_parallel, dp_mode
    cfg.memory.zero = zero
    if not two_bw:  # 2BW passes the trainer's own checks only (see two_bw_config)
        cfg.validate()
    return cfg


def _frozen_facts(trainer: Trainer) -> dict:
    """The base is frozen on this rank: checked here, and the bytes the engine holds for
    training (moments, gradient buckets, masters) returned beside the adapters' own bytes."""
    models = getattr(trainer.engine, "copies", [trainer.model])  # 2BW: both weight versions
    for model in models:
        for name, p in model.named_parameters():
            assert p.requires_grad == is_adapter(name), name
            assert p.grad is None or is_adapter(name), f"frozen {name} has a .grad"
    local = sum(4 * p.numel() for n, p in trainer.model.named_parameters() if is_adapter(n))
    memory = trainer.engine.memory
    if trainer.cfg.parallel.two_bw:  # plait's AdamW over whole trainable parameters
        opt = trainer.engine.optimizer
        assert all(is_adapter(n) for g in opt.groups for n in g.names), "a frozen group"
        moments = [t for s in opt.states.states for k, t in s.items() if k != "master"]
        states = sum(4 * t.numel() for t in moments)
        return {"adapter_bytes": local, "states": states, "storages": _storages(models)}
    return {
        "adapter_bytes": local,
        "states": memory.current("optimizer_states"),
        "grads": memory.current("gradients"),
        "masters": memory.current("master_weights"),
        "params": memory.current("parameters"),
        "base_bytes": sum(
            t.element_size() * t.numel()
            for n, t in trainer.model.named_parameters()
            if not is_adapter(n)
        ),
        "bytes": trainer.comm.stats.bytes_by_op(),
        "dp_grad_bytes": sum(r["bytes"] for r in _dp_grad_rows(trainer)),
        "dp_grad_calls": sum(r["calls"] for r in _dp_grad_rows(trainer)),
    }


def _dp_grad_rows(trainer: Trainer) -> list[dict]:
    """The comm layer's records of gradients sent over dp (this step's)."""
    return [r for r in trainer.comm.stats.as_rows() if r["axis"] == "dp" and r["tag"] == "grad"]


def _storages(models: list) -> dict[str, tuple[int, int]]:
    """Distinct storages of the frozen and of the trainable parameters over both weight
    copies, beside how many of each one copy holds."""

    def count(frozen: bool, ms: list) -> int:
        ps = [p for m in ms for p in m.parameters() if p.requires_grad != frozen]
        return len({p.untyped_storage().data_ptr() for p in ps})

    return {"held": (count(True, models), count(False, models)),
            "one_copy": (count(True, models[:1]), count(False, models[:1]))}  # fmt: skip


def lora_parity(steps: int = 4, **kw) -> dict:
    """Train `lora_config(**kw)` in the world's layout for `steps` steps and compare with one
    process; returns the step losses and `_frozen_facts` of this rank."""
    cfg = lora_config(steps, **kw)
    corpus = corpus_for(cfg)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus)
    start = whole_params(trainer)
    results = [trainer.train_step() for _ in range(steps)]
    val = trainer.evaluate()
    params = whole_params(trainer)
    facts = _frozen_facts(trainer)
    trainer.close()
    for name, p in params.items():  # the base never moves; every adapter trained
        if is_adapter(name):
            assert not torch.equal(p, start[name]), f"adapter {name} did not train"
        else:
            assert torch.equal(p, start[name]), f"frozen {name} changed"
    if cfg.parallel.two_bw:
        _assert_delayed(cfg, corpus, results, params, val)
    else:
        assert_matches_reference(cfg, corpus, results, params, val, PARAM_ATOL)
    adapters = sorted(n for n in params if is_adapter(n))
    return {"losses": [r.loss for r in results], "adapters": adapters, **facts}


def _assert_delayed(cfg: Config, corpus, results: list, params: dict, val: float) -> None:
    """2BW against its single-process rule (W(k+1) from the gradient at W(k-1))."""
    losses, norms, ref_params, ref_val = delayed_reference(cfg, corpus, len(results))
    torch.testing.assert_close(torch.tensor([r.loss for r in results]), torch.tensor(losses),
                               rtol=RTOL, atol=0)  # fmt: skip
    torch.testing.assert_close(torch.tensor([r.grad_norm for r in results]),
                               torch.tensor(norms), rtol=RTOL, atol=0)  # fmt: skip
    tied = cfg.model.tie_embeddings
    for name, p in params.items():
        ref = ref_params["embed.tok.weight" if tied and name == "head.weight" else name]
        torch.testing.assert_close(p, ref, rtol=RTOL, atol=PARAM_ATOL, msg=lambda m, n=name: n + m)
    assert abs(val - ref_val) <= RTOL * abs(ref_val), (val, ref_val)
