"""QLoRA runs for the layout tests (no tests here): tests/test_nf4_layouts.py runs `nf4_run`
on every rank of a harness world and once in the test process, as one process.

The model is small-llama cut to 2 blocks (d_model 128, ffn 512): every block Linear splits
over tp=2 into whole 64-weight NF4 blocks. The base is quantized from the seed's weights, once
per weight, whole, in every layout (each rank keeping its slice), so every layout computes with
the same dequantized numbers and must reproduce one process's losses and gradient norms
(rtol 1e-5) and adapters.
"""

from __future__ import annotations

import torch

from lora_parity import lora_config
from plait.config import Config
from plait.mesh import build_mesh
from plait.models.declare import is_adapter
from plait.parallel.tp.sharding import full_tensor, param_shard_specs
from plait.train import Trainer
from reference import corpus_for


def nf4_config(
    steps: int,
    zero: int = 0,
    offload_activations: str = "none",
    reshard_after_forward: str = "default",
    **kw,
) -> Config:
    kw.setdefault("preset", "small-llama")
    kw.setdefault("n_layers", 2)
    cfg = lora_config(steps, **kw)
    cfg.lora.base_dtype, cfg.memory.zero = "nf4", zero
    cfg.memory.offload_activations = offload_activations
    cfg.memory.reshard_after_forward = reshard_after_forward
    cfg.validate()
    return cfg


def nf4_run(steps: int = 4, **kw) -> dict:
    """Train `nf4_config(steps, **kw)` in this world's layout; this rank's step losses and
    gradient norms, validation loss, whole adapters of its stages and held bytes."""
    cfg = nf4_config(steps, **kw)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus_for(cfg))
    results = [trainer.train_step() for _ in range(steps)]
    rows = trainer.comm.stats.as_rows()  # the last step's collectives
    val = trainer.evaluate()
    specs = param_shard_specs(trainer.model)
    with trainer.engine.unsharded():  # ZeRO-3: every parameter (and NF4 block) gathered
        adapters = {
            n: full_tensor(p, specs[n], trainer.comm) if n in specs else p.detach().clone()
            for n, p in trainer.model.named_parameters()
            if is_adapter(n)
        }
    memory = trainer.engine.memory
    out = {
        "gathered": {
            tag: sum(r["bytes"] for r in rows if r["tag"] == tag and r["op"] == "all_gather")
            for tag in ("nf4", "frozen")
        },
        "losses": [r.loss for r in results],
        "norms": [r.grad_norm for r in results],
        "val": val,
        "adapters": adapters,
        "params": memory.current("parameters"),
        "states": memory.current("optimizer_states"),
    }
    trainer.close()
    return out


def assert_same_run(got: dict, want: dict, param_atol: float = 5e-5) -> None:
    """A layout's run against one process's: losses, norms, validation (rtol 1e-5) and the
    adapters it holds (Adam turns rounding-order differences into ~1e-6)."""
    rtol = 1e-5
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]), rtol=rtol,
                                   atol=0, msg=lambda m, k=key: f"{k}: {m}")  # fmt: skip
    assert abs(got["val"] - want["val"]) <= rtol * abs(want["val"]), (got["val"], want["val"])
    assert got["adapters"]
    for name, t in got["adapters"].items():
        torch.testing.assert_close(t, want["adapters"][name], rtol=rtol, atol=param_atol,
                                   msg=lambda m, n=name: n + m)  # fmt: skip
