"""The gradient rules' norm and clipping (parallel/grads.py), without processes.

The global norm must not depend on how gradients are chunked into buckets or shards: a single
process with the default 25 MiB buckets reports the norm a run with tiny buckets reports
(one long float32 reduction over a whole bucket drifts by 1e-5 relative on small-gpt).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from plait.build.model import build_model
from plait.comm import Comm
from plait.config import OptimConfig
from plait.mesh import single_process_mesh
from plait.models.presets import get_preset
from plait.parallel.adamw import AdamW
from plait.parallel.grads import NORM_CHUNK, SplitGradRules, clip_coef, squared_norm
from plait.parallel.zero.engine import ZeroEngine
from plait.parallel.zero.options import ZeroOptions

CPU = torch.device("cpu")


def random_grads(seed: int, scale: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,), (3, NORM_CHUNK + 11)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) * scale for s in shapes]


def torch_clip(grads: list[torch.Tensor], max_norm: float) -> tuple[float, list[torch.Tensor]]:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm), [p.grad for p in params]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_norm_and_clip_match_torch(seed: int, max_norm: float) -> None:
    grads = random_grads(seed, scale=1.0)
    ref_norm, ref_grads = torch_clip(grads, max_norm)
    norm = squared_norm(grads, CPU).sqrt()
    exact = math.sqrt(sum(float((g**2).sum()) for g in grads))
    assert float(norm) == pytest.approx(exact, rel=1e-12)
    assert float(norm) == pytest.approx(ref_norm, rel=1e-12)
    coef = clip_coef(norm, max_norm)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g * coef, r, rtol=1e-6, atol=0)
    assert (coef < 1.0) == (max_norm < exact)


def test_clip_off_and_below_max() -> None:
    small = squared_norm(random_grads(3, scale=1e-3), CPU).sqrt()
    assert clip_coef(small, 1.0) == 1.0  # below max: untouched
    big = squared_norm(random_grads(4, scale=100.0), CPU).sqrt()
    assert float(big) > 100.0 and clip_coef(big, 0.0) == 1.0  # 0 = off


def test_norm_does_not_depend_on_chunking() -> None:
    """fp32 values cut into buckets or shards anywhere give the same norm as per parameter."""
    grads = [g.float() for g in random_grads(5, scale=2.0)]
    flat = torch.cat([g.reshape(-1) for g in grads])
    per_param = float(squared_norm(grads, CPU))
    for cuts in ([flat.numel() // 2], [3, 50, 1000, NORM_CHUNK + 7], []):
        pieces = list(flat.tensor_split(cuts)) if cuts else [flat]
        assert float(squared_norm(pieces, CPU)) == pytest.approx(per_param, rel=1e-7)
    exact = float(flat.double().square().sum())
    assert per_param == pytest.approx(exact, rel=1e-7)


def _norm_at(bucket_mb: float, model_state: dict, x: torch.Tensor) -> float:
    model = build_model(get_preset("small-gpt"), CPU, seed=0)
    model.load_state_dict(model_state)
    comm = Comm(single_process_mesh())
    adamw = AdamW.from_optim(OptimConfig())
    engine = ZeroEngine(model, comm, adamw, ZeroOptions(bucket_mb=bucket_mb))
    engine.micro_batch(is_last=True)
    model(x, x).backward()
    engine.finish()
    norm = float(engine.grad_norm(SplitGradRules.of(model, comm.mesh)))
    groups = len(engine.groups)
    engine.close()
    return norm, groups


def test_default_bucket_size_reports_the_tiny_bucket_norm() -> None:
    """small-gpt in one process: 25 MiB buckets (the default) and 0.02 MiB buckets agree, and
    both equal the float64 norm of the per-parameter gradients."""
    torch.manual_seed(0)
    x = torch.randint(0, 256, (4, 64))
    model = build_model(get_preset("small-gpt"), CPU, seed=0)
    model(x, x).backward()
    exact = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    state = model.state_dict()
    default, few = _norm_at(25.0, state, x)
    tiny, many = _norm_at(0.02, state, x)
    assert few < many  # the default really packs the model into fewer, larger buckets
    assert default == pytest.approx(tiny, rel=1e-7)
    assert default == pytest.approx(exact, rel=1e-7)
