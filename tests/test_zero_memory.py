"""The memory tracker, the ZeRO formulas, and the engine's option errors (no processes)."""

from __future__ import annotations

import pytest
import torch

from plait.build.model import build_model
from plait.comm import Comm
from plait.composition import check_zero
from plait.config import OptimConfig
from plait.errors import ConfigError
from plait.estimate.formulas import zero_comm_elements, zero_model_state_bytes
from plait.memory_tracker import MemoryTracker
from plait.mesh import single_process_mesh
from plait.mixed_precision import DynamicLossScaler
from plait.models.presets import get_preset
from plait.parallel.activation_recompute import apply_recompute
from plait.parallel.adamw import AdamW
from plait.parallel.grads import SplitGradRules
from plait.parallel.zero.engine import ZeroEngine
from plait.parallel.zero.options import ZeroOptions


def test_formulas_are_the_papers():
    psi, n = 1000, 4
    mixed = dict(param_bytes=2, grad_bytes=2, optim_bytes=12)
    assert [zero_model_state_bytes(s, psi, n, **mixed) for s in range(4)] == [
        16 * psi,
        4 * psi + 12 * psi / n,
        2 * psi + 14 * psi / n,
        16 * psi / n,
    ]
    fp32 = dict(param_bytes=4, grad_bytes=4, optim_bytes=8)
    assert zero_model_state_bytes(2, psi, n, **fp32) == 4 * psi + 12 * psi / n
    assert zero_comm_elements(0, psi) == {"all_reduce": psi}
    assert zero_comm_elements(1, psi, 3) == {"reduce_scatter": psi, "all_gather": psi}
    assert zero_comm_elements(3, psi) == {"all_gather": 2 * psi, "reduce_scatter": psi}
    with pytest.raises(ValueError, match="ZeRO stage must be 0, 1, 2 or 3; got 4"):
        zero_model_state_bytes(4, psi, n, **mixed)


def test_tracker_current_peak_and_persistent():
    t = MemoryTracker()
    t.track("w", "parameters", torch.empty(10))  # 40 bytes, measured from the storage
    t.track("b", "comm_buffers", 100, transient=True)
    t.track("m", "optimizer_states", 64, place="host")
    assert t.current() == 140 and t.peak() == 140 and t.current(place="host") == 64
    t.release("b")
    assert t.current() == 40 and t.peak() == 140 and t.peak("comm_buffers") == 100
    t.begin_step()
    assert t.peak() == 40 and t.peak("comm_buffers") == 0
    t.track("w", "parameters", 80)  # re-tracking a key resizes it
    assert t.model_state_bytes() == 80 and t.model_state_bytes("host") == 64
    report = t.report()
    assert report["peak_total"]["device"] == 80 and report["allocator_peak"] is None
    with pytest.raises(ValueError, match="unknown memory category 'weights'"):
        t.track("x", "weights", 1)


def test_activation_meter_counts_saved_tensors_and_sees_recomputation():
    cfg = get_preset("tiny-gpt")
    x = torch.randint(0, 256, (2, 16))

    def saved(recompute: str) -> int:
        model = build_model(cfg, torch.device("cpu"), 0)
        apply_recompute(model, recompute)
        t = MemoryTracker()
        with t.activations():
            model(x, x).backward()
        assert t.current("activations") == 0  # released when the block ends
        return t.peak("activations")

    plain, full = saved("none"), saved("full")
    logits = 2 * 16 * 256 * 4  # the fp32 logits alone are saved for the loss
    assert plain > 4 * logits and 0 < full < plain / 2


def test_activation_meter_lets_a_graph_kept_past_its_backward_go():
    """A node that saves its own output (exp) and a graph kept for a second backward (ZB-H1
    keeps it from B to W): the meter must not hold the output with its grad_fn, or the
    graph (and its saved tensors) would never be freed."""
    t = MemoryTracker()
    x = torch.randn(64, requires_grad=True)
    with t.activations():
        y = (x * 2).exp()
        y.sum().backward(retain_graph=True)
        assert t.current("activations") == 64 * 4
        del y  # the last reference to the graph: its saved output goes with it
        assert t.current("activations") == 0


def _engine(**kw) -> ZeroEngine:
    model = build_model(get_preset("tiny-gpt"), torch.device("cpu"), 0)
    adamw = AdamW.from_optim(OptimConfig())
    return ZeroEngine(model, Comm(single_process_mesh()), adamw, ZeroOptions(**kw))


def test_option_errors_name_the_values(tmp_path):
    with pytest.raises(ConfigError, match="zero stage must be 0, 1, 2 or 3; got 5"):
        check_zero(5, "none", None)
    with pytest.raises(ConfigError, match="offload must be one of none, cpu, nvme; got 'gpu'"):
        check_zero(1, "gpu", None)
    with pytest.raises(ConfigError, match="offload 'nvme' needs a directory"):
        check_zero(1, "nvme", None)
    with pytest.raises(ConfigError, match="--offload-dir '/x' is only used with --offload nvme"):
        check_zero(1, "cpu", "/x")
    with pytest.raises(ConfigError, match="schedule 2bw keeps its own two weight versions"):
        check_zero(2, "none", None, pp=2, schedule="2bw")
    with pytest.raises(ConfigError, match="a loss scaler is for fp16; precision is bf16"):
        _engine(precision="bf16", scaler=DynamicLossScaler())
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot create offload directory"):
        _engine(stage=1, offload="nvme", offload_dir=blocker / "sub")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="Sequential declares no model contract"):
        ZeroEngine(model, Comm(single_process_mesh()), AdamW(), ZeroOptions(stage=3))


def test_single_rank_engine_steps_every_stage():
    """dp = 1: no collectives, every stage still trains (the degenerate layout works)."""
    x = torch.randint(0, 256, (2, 16))
    losses = []
    for stage in range(4):
        engine = _engine(stage=stage, precision="bf16")
        for _ in range(2):
            engine.micro_batch(is_last=True)
            loss = engine.model(x, x)
            engine.scale_loss(loss).backward()
            engine.finish()
            assert engine.grad_norm(SplitGradRules.of(engine.model, engine.comm.mesh)) > 0
            assert engine.step(1e-2)
            engine.zero_grad()
        losses.append(float(loss.detach()))
        engine.close()
    assert len(set(losses)) == 1  # all stages: the same two steps


def test_stage3_evaluates_and_frees_and_exposes_gradient_pieces():
    x = torch.randint(0, 256, (2, 16))
    full, sharded = _engine(stage=0), _engine(stage=3)
    with torch.no_grad():  # evaluation: gathered block by block, all freed afterwards
        assert torch.equal(sharded.model(x, x), full.model(x, x))
    mem = sharded.memory
    assert mem.current("parameters") == mem.persistent("parameters") < mem.peak("parameters")
    sharded.micro_batch(is_last=True)
    sharded.model(x, x).backward()
    sharded.finish()
    pieces = sharded.grad_pieces()
    params = list(sharded.model.parameters())
    assert {id(p) for p, _ in pieces} == {id(p) for p in params}
    assert sum(v.numel() for _, v in pieces) == sum(p.numel() for p in params)
    squares = sum(float(v.double().pow(2).sum()) for _, v in pieces)
    norm = sharded.grad_norm(SplitGradRules.of(sharded.model, sharded.comm.mesh))
    assert float(norm) ** 2 == pytest.approx(squares, rel=1e-7)
    full.close()
    sharded.close()


class MomentumSGD:
    """An element-wise optimizer written against the protocol: SGD with momentum, the
    operations of torch.optim.SGD (a zero buffer makes its first-step copy implicit)."""

    state_names = ("momentum_buffer",)

    def update(self, param, grad, states, step, lr, decay) -> None:
        buf = states["momentum_buffer"]
        buf.mul_(0.9).add_(grad)
        param.add_(buf, alpha=-lr)


def test_any_elementwise_optimizer_plugs_in(tmp_path):
    x = torch.randint(0, 256, (2, 16))
    ref = build_model(get_preset("tiny-gpt"), torch.device("cpu"), 0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    engines = [
        ZeroEngine(
            build_model(get_preset("tiny-gpt"), torch.device("cpu"), 0),
            Comm(single_process_mesh()),
            MomentumSGD(),
            ZeroOptions(stage=2, **kw),
        )
        for kw in ({}, {"offload": "nvme", "offload_dir": tmp_path, "sub_group_mb": 0.01})
    ]
    for _ in range(3):
        ref(x, x).backward()
        opt.step()
        opt.zero_grad()
        for engine in engines:
            engine.micro_batch(is_last=True)
            engine.model(x, x).backward()
            engine.finish()
            engine.step(0.1)
            engine.zero_grad()
    for engine in engines:
        for p, q in zip(engine.model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q)
        states = engine.state_dict()["pieces"]
        assert set(states[0].tensors) == {"master", "momentum_buffer"}
        assert engine.memory.persistent("optimizer_states", engine.states.place) > 0
        engine.close()
