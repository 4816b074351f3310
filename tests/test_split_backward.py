"""Zero-bubble's split backward, without processes: B's input gradient and W's weight
gradients equal one plain backward, W runs no input-gradient work, and the fallbacks."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from plait.build.model import build_model
from plait.models.presets import get_preset
from plait.parallel.pipeline.split_backward import split_input_backward
from plait.parallel.pipeline.stage import run_stage
from plait.schedule.stages import StagePlan


def _stage(last: bool):
    """A middle or last stage of a 4-layer tiny GPT (layers 2-3), its input and its params."""
    cfg = get_preset("tiny-gpt")
    cfg.n_layers = 4
    model = build_model(cfg, torch.device("cpu"), seed=0)
    plan = StagePlan(stage=1, layers=range(2, 4), first=False, last=last)
    parts = [model.blocks[i] for i in plan.layers] + ([model.norm, model.head] if last else [])
    params = [p for part in parts for p in part.parameters()]
    gen = torch.Generator().manual_seed(1)
    inp = torch.randn(2, 16, cfg.d_model, generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    return model, plan, params, inp, targets


def _forward(model, plan, inp, targets):
    x = inp.clone().requires_grad_()
    out = run_stage(model, plan, x, None, targets if plan.last else None)
    grad = None if plan.last else torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    return x, out, grad


def _reference(model, plan, params, inp, targets):
    x, out, grad = _forward(model, plan, inp, targets)
    torch.autograd.backward(out, grad)
    ref = (x.grad.clone(), [p.grad.clone() for p in params])
    model.zero_grad(set_to_none=True)
    return ref


def test_split_equals_one_backward_and_w_does_only_weight_work():
    for last in (False, True):
        model, plan, params, inp, targets = _stage(last)
        ref_in, ref_params = _reference(model, plan, params, inp, targets)

        x, out, grad = _forward(model, plan, inp, targets)
        seen: list[str] = []
        x.register_hook(lambda g, seen=seen: seen.append("input"))
        grad_in, work = split_input_backward(out, grad, x, params)
        assert work is not None and seen == ["input"]
        assert all(p.grad is None for p in params)  # B computes no weight gradient
        torch.testing.assert_close(grad_in, ref_in, rtol=0, atol=0)

        with FlopCounterMode(display=False) as w_flops:
            work.run()
        assert seen == ["input"]  # W never reaches the input again
        for p, ref in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)

        # The plain split (a second backward from the output) costs more than W alone.
        model.zero_grad(set_to_none=True)
        x2, out2, grad2 = _forward(model, plan, inp, targets)
        torch.autograd.grad(out2, x2, grad2, retain_graph=True)
        with FlopCounterMode(display=False) as plain_flops:
            torch.autograd.backward(out2, grad2, inputs=params)
        assert w_flops.get_total_flops() < plain_flops.get_total_flops()


def test_post_accumulate_hooks_fire_in_w():
    model, plan, params, inp, targets = _stage(last=False)
    fired = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda t: fired.append(id(t)))
    x, out, grad = _forward(model, plan, inp, targets)
    _, work = split_input_backward(out, grad, x, params)
    assert fired == []
    work.run()
    assert sorted(fired) == sorted(id(p) for p in params)


class _Shared(nn.Module):
    """One weight applied twice: two junctions, one below the other on the chain."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)) * self.gain)


def test_weight_used_twice_is_counted_once():
    torch.manual_seed(0)
    mod = _Shared()
    params = list(mod.parameters())
    inp, g = torch.randn(4, 8), torch.randn(4, 8)
    x = inp.clone().requires_grad_()
    mod(x).backward(g)
    ref = [p.grad.clone() for p in params]
    mod.zero_grad(set_to_none=True)

    x = inp.clone().requires_grad_()
    grad_in, work = split_input_backward(mod(x), g, x, params)
    torch.testing.assert_close(grad_in, torch.autograd.grad(mod(x), x, g)[0])
    work.run()
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r, rtol=1e-6, atol=1e-7)


def test_parameter_meeting_the_input_only_at_the_output():
    """A parameter whose path joins the input's only at the output's node: its junction is
    the output itself, and W still gets its gradient."""
    lin, bias = nn.Linear(4, 4), nn.Parameter(torch.ones(4))
    y = torch.randn(2, 4, requires_grad=True)
    loss = lin(y).sum() + bias.pow(2).sum()
    grad_in, work = split_input_backward(loss, None, y, [*lin.parameters(), bias])
    torch.testing.assert_close(grad_in, lin.weight.sum(0).expand(2, 4))
    work.run()
    torch.testing.assert_close(bias.grad, 2 * bias.detach())
    torch.testing.assert_close(lin.weight.grad, y.detach().sum(0).expand(4, 4))
