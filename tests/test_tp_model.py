"""Tensor-parallel transformer == single-process transformer (fp32), and its exact traffic.

Every check runs in one 4-rank gloo world: tp=4 (Layout(tp=4)) or tp=2 (Layout(dp=2, tp=2):
two tp groups, each computing the same batch). On every rank the plain single-process model
is built from the same seed and run on the same tokens and dropout keys; the tp model must
match it: initial parameters exactly (each shard is its slice), loss and every gradient
(shards gathered) to rtol 1e-5, and the global gradient norm.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.comm import Comm
from plait.errors import ConfigError
from plait.estimate.formulas import tp_comm_per_microbatch
from plait.mesh import build_mesh
from plait.models.architecture import ModelConfig
from plait.models.dropout import sample_keys
from plait.models.init import init_parameters
from plait.models.presets import get_preset
from plait.models.transformer import Transformer
from plait.parallel.activation_recompute import apply_recompute
from plait.parallel.grads import (
    SplitGradRules,
    clip_coef,
    param_grads,
    tp_partial_params,
)
from plait.parallel.tp.apply import apply_tensor_parallel
from plait.parallel.tp.sharding import full_tensor, param_shard_specs
from plait.parallel.tp.vocab import gather_logits
from plait.topology import Layout

RTOL = 1e-5
SEED = 7
B, S = 2, 16


def _setup(tp: int, preset: str, sp: bool, **over: object):
    """(cfg, reference model, tp model, comm) with the same seed."""
    world = torch.distributed.get_world_size()
    mesh = build_mesh(Layout(dp=world // tp, tp=tp), torch.device("cpu"))
    comm = Comm(mesh)
    cfg = dataclasses.replace(get_preset(preset), **over)
    ref = _build(cfg)
    model = _build(cfg, lambda m: apply_tensor_parallel(m, mesh, comm, sequence_parallel=sp))
    return cfg, ref, model, comm


def _build(cfg: ModelConfig, parallelize=None) -> Transformer:
    """What build/model.py build_model does: meta -> parallelize -> materialize -> initialize."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if parallelize is not None:
        parallelize(model)
    model.to_empty(device=torch.device("cpu"))
    init_parameters(model, SEED, cfg)
    return model


def _batch(cfg: ModelConfig, step: int = 0, counting: bool = False):
    """Random tokens, or (counting) runs start, start+1, ... that a model can learn fast."""
    gen = torch.Generator().manual_seed(100 + step)
    if counting:
        start = torch.randint(0, cfg.vocab_size, (B, 1), generator=gen)
        x = (start + torch.arange(S + 1)) % cfg.vocab_size
    else:
        x = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=gen)
    return x[:, :-1], x[:, 1:], sample_keys(SEED, step, torch.arange(B))


def _full(model: Transformer, comm: Comm, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) as the whole tensor, shards gathered."""
    specs = param_shard_specs(model)
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p.detach()
        out[name] = full_tensor(t, specs[name], comm) if name in specs else t
    return out


def _close(actual, expected, what: str) -> None:
    # Floor for entries near zero: 1e-5 of the tensor's scale, and 1e-8 for tensors whose
    # exact gradient is zero (k's bias: softmax ignores a per-query constant) and whose
    # computed one is rounding noise on both sides.
    atol = max(1e-5 * float(expected.abs().max()), 1e-8)
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- forward and backward
def _forward_backward(tp: int, preset: str, sp: bool, recompute: str, over: dict) -> float:
    cfg, ref, model, comm = _setup(tp, preset, sp, dropout=0.1, **over)
    ref_params = dict(ref.named_parameters())
    for name, value in _full(model, comm, grads=False).items():  # layout-independent init
        assert torch.equal(value, ref_params[name].detach()), f"initial {name}"
    apply_recompute(model, recompute)
    x, y, keys = _batch(cfg)
    ref.train(), model.train()
    ref_loss = ref(x, y, keys)
    ref_loss.backward()
    loss = model(x, y, keys)
    loss.backward()
    rules = SplitGradRules.of(model, comm.mesh)
    rules.sync(param_grads(model), comm)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
    for name, grad in _full(model, comm, grads=True).items():
        _close(grad, ref_params[name].grad, f"grad {name}")
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    norm = rules.norm(param_grads(model), comm).float()
    torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=0)
    ref.eval(), model.eval()  # logits without targets: vocabulary slices, gathered
    _close(gather_logits(model(x), comm, cfg.vocab_size), ref(x).detach(), "logits")
    return float(loss)


GQA4 = {"n_heads": 8, "n_kv_heads": 4}  # tiny-llama's kv=2 cannot split 4 ways
CASES = [
    # (tp, preset, sequence_parallel, recompute, overrides)
    (2, "tiny-gpt", False, "none", {}),
    (2, "tiny-gpt", True, "none", {}),
    (4, "tiny-gpt", False, "none", {}),
    (4, "tiny-gpt", True, "none", {"vocab_size": 250}),  # padded, tied vocabulary
    (2, "tiny-llama", False, "none", {}),
    (2, "tiny-llama", True, "selective", {}),
    (4, "tiny-llama", False, "full", {**GQA4, "vocab_size": 250}),  # padded, untied
    (4, "tiny-llama", True, "none", GQA4),
]


def _case_id(case) -> str:
    tp, preset, sp, recompute, over = case
    extra = "".join(f"-{k}={v}" for k, v in over.items())
    return f"{preset}-tp{tp}{'-sp' if sp else ''}-{recompute}{extra}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_backward_match_single_process(world4, case):
    losses = world4.run(_forward_backward, *case)
    assert len(set(losses)) == 1  # every tp rank (and both dp replicas) report the same loss


# ---------------------------------------------------------------- traffic
def _traffic(tp: int, preset: str, sp: bool, over: dict) -> dict:
    """Counted collectives of one micro-batch's forward, then its backward, by (op, tag)."""
    cfg, _, model, comm = _setup(tp, preset, sp, **over)
    x, y, keys = _batch(cfg)
    model.train()
    comm.stats.begin_step(0)
    loss = model(x, y, keys)
    fwd = {(r.op, r.tag): (r.calls, r.elements, r.bytes) for r in comm.stats.records.values()}
    comm.stats.begin_step(1)
    loss.backward()
    bwd = {(r.op, r.tag): (r.calls, r.elements, r.bytes) for r in comm.stats.records.values()}
    comm.stats.begin_step(2)
    SplitGradRules.of(model, comm.mesh).sync(param_grads(model), comm)
    synced = sum(p.numel() for p in tp_partial_params(model))
    sync = {(r.op, r.tag): (r.calls, r.elements) for r in comm.stats.records.values()}
    return {"fwd": fwd, "bwd": bwd, "sync": sync, "synced": synced, "layers": cfg.n_layers}


def _expected(n_layers: int, sp: bool) -> tuple[dict, dict]:
    """Per micro-batch, in fp32, from the one home of the formula (estimate/formulas.py:
    Megatron's 2 all-reduces forward and 2 backward per layer; SP's all-gather +
    reduce-scatter pairs), which the planner also prices."""
    fwd, bwd = tp_comm_per_microbatch(n_layers, B * S * 64, B * S, sp)

    def with_bytes(table: dict) -> dict:
        return {k: (calls, el, 4 * el) for k, (calls, el) in table.items()}

    return with_bytes(fwd), with_bytes(bwd)


def _partial_elements(preset: str, n_layers: int, h: int = 64, max_seq: int = 64) -> int:
    """Parameters replicated over tp whose gradients are partial under SP."""
    if preset == "tiny-gpt":  # LayerNorm weight+bias x2, wo and fc2 biases; final norm; positions
        return n_layers * (4 * h + 2 * h) + 2 * h + max_seq * h
    return n_layers * 2 * h + h  # RMSNorm weights only (no biases, RoPE)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-llama"])
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_collectives_per_layer_and_micro_batch(world4, preset, sp, tp):
    over = GQA4 if preset == "tiny-llama" and tp == 4 else {}
    got = world4.run(_traffic, tp, preset, sp, over)[0]
    fwd, bwd = _expected(got["layers"], sp)
    assert got["fwd"] == fwd
    assert got["bwd"] == bwd
    if sp:  # one flat all-reduce per step of every partial gradient
        assert got["synced"] == _partial_elements(preset, got["layers"])
        assert got["sync"] == {("all_reduce", "tp-sp-grads"): (1, got["synced"])}
    else:
        assert got["sync"] == {} and got["synced"] == 0


# ---------------------------------------------------------------- training
def _train(tp: int, preset: str, sp: bool, steps: int, over: dict) -> list[float]:
    """`steps` AdamW steps with global-norm clipping: losses and final parameters match."""
    cfg, ref, model, comm = _setup(tp, preset, sp, dropout=0.1, **over)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (ref, model)]
    ref.train(), model.train()
    losses = []
    for step in range(steps):
        x, y, keys = _batch(cfg, step, counting=True)
        ref_loss, loss = ref(x, y, keys), model(x, y, keys)
        ref_loss.backward()
        loss.backward()
        rules = SplitGradRules.of(model, comm.mesh)
        rules.sync(param_grads(model), comm)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        norm_t = rules.norm(param_grads(model), comm)
        coef = clip_coef(norm_t, 0.5)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
        norm = float(norm_t)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0, msg=f"loss at step {step}")
        torch.testing.assert_close(norm, float(ref_norm), rtol=RTOL, atol=0)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    ref_params = dict(ref.named_parameters())
    for name, value in _full(model, comm, grads=False).items():
        # Adam divides by sqrt(v): rounding-level gradient differences reach ~1e-6 absolute.
        expected = ref_params[name].detach()
        msg = lambda m, n=name: f"{n} after {steps} steps: {m}"  # noqa: E731
        torch.testing.assert_close(value, expected, rtol=RTOL, atol=1e-5, msg=msg)
    for p in model.parameters():  # padding rows stay zero through Adam and weight decay
        assert p.isfinite().all()
    specs = param_shard_specs(model)
    for name, spec in specs.items():
        p = dict(model.named_parameters())[name]
        assert not p.narrow(spec.dim, spec.local_shape[spec.dim], spec.padding).any(), name
    return losses


@pytest.mark.parametrize(
    "case",
    [
        (4, "tiny-gpt", True, {"vocab_size": 250}),
        (2, "tiny-llama", False, {}),
    ],
    ids=["tiny-gpt-tp4-sp-vocab250", "tiny-llama-tp2"],
)
def test_training_matches_single_process(world4, case):
    losses = world4.run(_train, case[0], case[1], case[2], 10, case[3])
    assert losses[0] == losses[-1]
    assert losses[0][-1] < losses[0][0]  # it learns


# ---------------------------------------------------------------- metadata and errors
def _metadata_and_errors() -> None:
    cfg, _, model, comm = _setup(4, "tiny-llama", True, **GQA4)
    r = comm.mesh.axis_rank("tp")
    specs = param_shard_specs(model)
    wq, wo = specs["blocks.0.attn.wq.weight"], specs["blocks.0.attn.wo.weight"]
    assert (wq.global_shape, wq.offsets, wq.local_shape) == ((64, 64), (16 * r, 0), (16, 64))
    assert (wo.global_shape, wo.offsets, wo.local_shape) == ((64, 64), (0, 16 * r), (64, 16))
    assert specs["head.weight"].global_shape == (256, 64)  # untied: its own shards
    assert "blocks.0.attn_norm.weight" not in specs  # replicated
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in Transformer(cfg).named_parameters()]  # names unchanged
    with torch.device("meta"):
        bad = Transformer(get_preset("tiny-llama"))  # kv heads 2
    with pytest.raises(ConfigError, match=r"n_kv_heads=2 is not divisible by tp=4"):
        apply_tensor_parallel(bad, comm.mesh, comm)
    x, y, keys = _batch(cfg)
    with pytest.raises(ValueError, match="sequence length 15 is not divisible by tp=4"):
        model(x[:, :15], y[:, :15], keys)


def test_sharding_metadata_and_errors(world4):
    world4.run(_metadata_and_errors)
