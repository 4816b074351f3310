"""The lighter loss (models/light_loss.py): the head and cross entropy over the target rows
only, in chunks, recomputed in backward. It must give the plain loss and gradients (rtol
1e-6: only the order of the sums over rows changes) on text windows, on packed instruction
rows full of IGNORE targets, on a micro-batch with no target, and under tp2 and tp2+SP; and
save per target row only its head input, index, target and log-sum-exp (the meter's bytes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from packed_rows import PackedRows
from plait.comm import Comm
from plait.estimate.activations import MicroShape, target_rows_bytes
from plait.memory_tracker import MemoryTracker
from plait.mesh import build_mesh
from plait.models.architecture import ModelConfig
from plait.models.light_loss import target_rows_loss
from plait.models.loss import IGNORE, LMLoss
from plait.models.presets import get_preset
from plait.models.transformer import Transformer
from plait.parallel.tp.layers import ColumnParallelLinear
from plait.parallel.tp.vocab import VocabParallelCrossEntropy
from plait.topology import Layout

B, S, H, V = 3, 16, 8, 37  # V odd: under tp2 the vocabulary is padded to 38
RTOL = 1e-6


def _targets(kind: str) -> torch.Tensor:
    if kind == "text":
        return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    if kind == "packed":
        return PackedRows(B, S, V, seed=3).targets
    return torch.full((B, S), IGNORE)  # no target at all


def _leaves(seed: int = 0) -> tuple[torch.Tensor, nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, H, generator=gen), nn.Parameter(torch.randn(V, H, generator=gen))


def _loss_and_grads(light: bool, targets, denom, chunk: int) -> list[torch.Tensor]:
    x, w = _leaves()
    x.requires_grad_()
    loss_fn = LMLoss()
    if light:
        loss = target_rows_loss(x, w, targets, loss_fn.chunk_losses, loss_fn.vocab, denom, chunk)
    else:
        loss = loss_fn(F.linear(x, w), targets, denom)
    loss.backward()
    return [loss.detach(), x.grad, w.grad]


@pytest.mark.parametrize("chunk", [5, 4096])
@pytest.mark.parametrize("denom", [None, 11.0])
@pytest.mark.parametrize("kind", ["text", "packed", "none"])
def test_matches_plain_loss_and_gradients(kind, denom, chunk):
    targets = _targets(kind)
    if kind == "packed":
        counted = int((targets != IGNORE).sum())
        assert 0 < counted < B * S // 2, counted  # mostly prompts and pads
    plain = _loss_and_grads(False, targets, denom, chunk)
    light = _loss_and_grads(True, targets, denom, chunk)
    for a, b in zip(light, plain, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-7)
    if kind == "none":
        assert light[0].item() == 0.0 and not light[1].any() and not light[2].any()


def test_model_output_matches_head_then_loss():
    """Transformer.output takes the light path; its loss equals the logits' plain loss."""
    cfg = ModelConfig(**{**get_preset("small-llama").__dict__, "n_layers": 1})
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = PackedRows(2, 16, cfg.vocab_size, seed=5).targets
    logits = model(tokens)
    assert logits.shape == (2, 16, cfg.vocab_size)  # no targets: logits, unchanged
    torch.testing.assert_close(model(tokens, targets), LMLoss()(logits, targets), rtol=RTOL, atol=0)


def _saved_bytes(light: bool, targets: torch.Tensor) -> int:
    base, w = _leaves()
    x = base.requires_grad_() * 2.0  # not a leaf: the meter counts what is saved of it
    tracker = MemoryTracker()
    loss_fn = LMLoss()
    with tracker.activations():
        if light:
            loss = target_rows_loss(x, w, targets, loss_fn.chunk_losses, loss_fn.vocab, 7.0, 5)
        else:
            loss = loss_fn(F.linear(x, w), targets, 7.0)
        peak = tracker.peak("activations")
        loss.backward()
    return peak


def test_saved_bytes_are_the_target_rows_only():
    """Plain: the head input, the fp32 logits' softmax, the targets, NLL's weight. Light: per
    counted row the head input (h·4), its index and target (8 each), its lse (4)."""
    cfg = ModelConfig(**{**get_preset("small-llama").__dict__, "d_model": H})
    for kind in ("text", "packed", "none"):
        targets = _targets(kind)
        n = int((targets != IGNORE).sum())
        light = _saved_bytes(True, targets)
        assert light == n * (H * 4 + 8 + 8 + 4)
        assert light == target_rows_bytes(cfg, MicroShape(B, S, 1, False, 4), rows=n)
        assert _saved_bytes(False, targets) == B * S * (H * 4 + V * 4 + 8) + 4


def test_bad_chunk_is_refused():
    x, w = _leaves()
    with pytest.raises(ValueError, match="chunk must be at least 1 row, got 0"):
        target_rows_loss(x, w, _targets("text"), LMLoss().chunk_losses, (0, None), None, 0)


# ---------------------------------------------------------------- tensor parallelism
def _tp2(sequence_parallel: bool) -> list[bool]:
    """Per target kind: whether the light loss and gradients match the plain tp loss."""
    comm = Comm(build_mesh(Layout(tp=2), torch.device("cpu")))
    rank = comm.mesh.axis_rank("tp")
    ok = []
    for kind in ("text", "packed", "none"):
        targets = _targets(kind)
        out = []
        for light in (False, True):
            full, w = _leaves()
            head = ColumnParallelLinear.from_linear(
                _linear(w), comm, enter=True, sequence_parallel=sequence_parallel, pad=True
            )
            x = full.chunk(2, dim=1)[rank] if sequence_parallel else full
            x = x.clone().requires_grad_()
            loss_fn = VocabParallelCrossEntropy(V, comm)
            if light:
                rows = head.region_input(x)
                loss = target_rows_loss(
                    rows, head.weight, targets, loss_fn.chunk_losses, loss_fn.vocab, 9.0, 5
                )
            else:
                loss = loss_fn(head(x), targets, 9.0)
            loss.backward()
            out.append([loss.detach(), x.grad, head.weight.grad])
        ok.append(
            all(
                torch.isfinite(a).all() and torch.allclose(a, b, rtol=RTOL, atol=1e-7)
                for a, b in zip(*out, strict=True)
            )
        )
    return ok


def _linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(H, V, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_matches_plain_vocab_parallel_loss(world2, sp):
    for ok in world2.run(_tp2, sp):
        assert ok == [True, True, True]
