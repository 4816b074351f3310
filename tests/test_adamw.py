"""plait's one AdamW (`parallel/adamw.py`) is torch's AdamW, on flat slices and on whole
parameters (`parallel/whole_adamw.py`, the engines that shard nothing), with the same
weight-decay groups; whole-parameter state comes out as checkpoint pieces and goes back in;
frozen parameters get no state. Pure: no processes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from plait.config import OptimConfig
from plait.memory_tracker import MemoryTracker
from plait.optim import build_optimizer, set_lr
from plait.parallel.adamw import AdamW, decays
from plait.parallel.whole_adamw import WholeAdamW, trainable
from plait.parallel.zero.state_dict import assemble
from reference import Tiny

CFG = OptimConfig(weight_decay=0.1, beta1=0.9, beta2=0.95)
LRS = [1e-2, 3e-2, 2e-2, 1e-3, 5e-3]


def _grads(model: nn.Module, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(p.shape, generator=gen) for p in model.parameters() if p.requires_grad]


def _whole(model: nn.Module, tracker: MemoryTracker | None = None) -> WholeAdamW:
    named = trainable(list(model.named_parameters()))
    names, params = [n for n, _ in named], [p for _, p in named]
    return WholeAdamW(names, params, AdamW.from_optim(CFG), tracker or MemoryTracker())


def test_adamw_is_bitwise_torch_adamw():
    """Element-wise AdamW on one flat buffer = torch AdamW with decay/no-decay groups."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 6), (6,), (3, 5)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": CFG.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    torch_opt = torch.optim.AdamW(groups, lr=1.0, betas=(CFG.beta1, CFG.beta2), eps=1e-8)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    states = {"exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
    decay = [(0, 24), (30, 45)]  # the two matrices, not the vector between them
    for step, lr in enumerate(LRS, start=1):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
        flat_grad = torch.cat([g.reshape(-1) for g in grads])
        AdamW.from_optim(CFG).update(flat, flat_grad, states, step, lr, decay)
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in params]))
    torch_avg = torch.cat([torch_opt.state[p]["exp_avg"].reshape(-1) for p in params])
    assert torch.equal(states["exp_avg"], torch_avg)


def test_whole_parameters_step_as_torch_adamw_with_its_groups():
    """Several steps over whole parameters = torch AdamW from `build_optimizer` (the groups
    the references and peers use), bit for bit; the frozen weight is untouched, stateless."""
    ref, model = Tiny(), Tiny()
    model.load_state_dict(ref.state_dict())
    frozen = model.frozen.weight.detach().clone()
    torch_opt = build_optimizer(ref, CFG)
    tracker = MemoryTracker()
    ours = _whole(model, tracker)
    gen = torch.Generator().manual_seed(1)
    params = [p for p in model.parameters() if p.requires_grad]
    for step, lr in enumerate(LRS, start=1):
        grads = _grads(model, gen)
        for p, g in zip((p for p in ref.parameters() if p.requires_grad), grads, strict=True):
            p.grad = g.clone()
        set_lr(torch_opt, lr)
        torch_opt.step()
        ours.step(params, grads, step, lr)
    for (name, want), got in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want), name
    assert torch.equal(model.frozen.weight, frozen)
    named = dict(ref.named_parameters())
    for piece in ours.pieces(params):
        for key in ("exp_avg", "exp_avg_sq"):
            want = torch_opt.state[named[piece.name]][key].reshape(-1)
            assert torch.equal(piece.tensors[key], want), (piece.name, key)
    moments = 2 * 4 * sum(p.numel() for p in params)  # fp32, trainable parameters only
    assert tracker.current("optimizer_states") == moments


def test_decay_is_the_same_rule_for_both_adamws():
    """Matrices and embeddings decay; biases and norm gains do not; frozen: in no group."""
    model = Tiny()
    decay, no_decay = build_optimizer(model, CFG).param_groups
    assert [id(p) for p in decay["params"]] == [id(model.emb.weight), id(model.proj.weight)]
    assert all(not decays(p) for p in no_decay["params"])
    ours = _whole(model)
    spans = {g.names[0]: g.decay_segments() for g in ours.groups}
    assert spans == {
        "emb.weight": [(0, 40)],
        "norm.weight": [],
        "norm.bias": [],
        "proj.weight": [(0, 12)],
        "proj.bias": [],
    }


def test_pieces_are_whole_layout_free_and_load_back():
    """Checkpoint pieces: one per trainable parameter, whole (start 0), master and moments;
    loaded into a fresh state on other tensors, the next step is the same."""
    model = Tiny()
    ours = _whole(model)
    gen = torch.Generator().manual_seed(2)
    params = [p for p in model.parameters() if p.requires_grad]
    for step in (1, 2):
        ours.step(params, _grads(model, gen), step, 1e-2)
    pieces = ours.pieces(params)
    assert [(s.name, s.start, s.length) for s in pieces] == [
        (n, 0, p.numel()) for n, p in model.named_parameters() if p.requires_grad
    ]
    assert all(set(s.tensors) == {"master", "exp_avg", "exp_avg_sq"} for s in pieces)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    again = _whole(other)
    other_params = [p for p in other.parameters() if p.requires_grad]
    again.load(other_params, assemble(pieces))
    for a, b in zip(params, other_params, strict=True):
        assert torch.equal(a, b)
    grads = _grads(model, gen)
    ours.step(params, grads, 3, 1e-2)
    again.step(other_params, grads, 3, 1e-2)
    for a, b in zip(params, other_params, strict=True):
        assert torch.equal(a, b)


def test_frozen_parameters_are_refused():
    model = Tiny()
    with pytest.raises(ValueError, match=r"frozen parameters get no optimizer state.*frozen"):
        WholeAdamW(["frozen.weight"], [model.frozen.weight], AdamW.from_optim(CFG), MemoryTracker())
