"""Partitioned activations (`--partition-activations`): bitwise the run without them and
within rtol 1e-5 of one process, at tp2 (full and selective recomputation, with activation
offload, RMSNorm, LoRA), tp2×pp2 (1F1B, ZB-H1) and tp2×dp2 under ZeRO-2; the extra
all-gathers counted by the comm layer equal their formula; the meter's saved activations drop
by what the estimate says; gradients reach the block input; bad input is one line. One 2-rank
and one 4-rank world for the module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.cli import main
from plait.comm import Comm
from plait.errors import ConfigError
from plait.estimate import estimate
from plait.estimate.partitioned import gathers_per_step
from plait.mesh import build_mesh
from plait.parallel.activation_recompute import checkpoint_module
from plait.parallel.partition_activations import TAG, gather_whole, partition_module, this_part
from plait.topology import Layout
from plait.train import Trainer
from reference import assert_matches_reference, corpus_for, small_config
from whole_params import whole_params

STEPS = 3


def _config(partition: bool, recompute: str, offload: str = "none", zero: int = 0, **layout):
    lora = layout.pop("lora_rank", None)
    cfg = small_config(steps=STEPS, accum=2, dropout=0.1, recompute=recompute, **layout)
    if lora:  # adapters on every projection; the frozen embedding feeds block 0
        cfg.model.lora_rank, cfg.model.lora_targets = lora, "all"
    cfg.memory.partition_activations, cfg.memory.offload_activations, cfg.memory.zero = (
        partition,
        offload,
        zero,
    )
    cfg.validate()
    return cfg


def _train(cfg) -> dict:
    """Losses, this rank's parameters (tp shards gathered), the metered second step's
    activation peaks and gathers, and the estimate's check against one process."""
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), 60)
    corpus = corpus_for(cfg)
    trainer = Trainer(cfg, mesh, corpus)
    results, peaks, gathers = [], {}, ()
    for step in range(STEPS):
        results.append(trainer.train_step(meter_activations=step == 1))
        if step == 1:
            tracker = trainer.engine.memory
            peaks = {p: tracker.peak("activations", p) for p in ("device", "host")}
            gathers = trainer.comm.stats.total(op="all_gather", tag=TAG)
    val = trainer.evaluate()
    params = whole_params(trainer)
    trainer.close()
    return {"results": results, "val": val, "params": params, "peaks": peaks,
            "gathers": gathers, "pp_rank": mesh.coord.pp, "corpus": corpus,
            "lead": mesh.coord.dp == mesh.coord.tp == 0}  # fmt: skip


def run_pair(recompute: str, offload: str = "none", zero: int = 0, **layout) -> list[dict]:
    """The same run without and with partitioning, on this rank; the partitioned one is
    checked against one process here, on the first dp and tp rank of each pipeline stage
    (and every rank's partitioned run equals its plain one bitwise: `_check`)."""
    out = []
    for partition in (False, True):
        cfg = _config(partition, recompute, offload, zero, **layout)
        got = _train(cfg)
        if partition and got["lead"]:  # one rank per pipeline stage holds its whole part
            assert_matches_reference(cfg, got.pop("corpus"), got["results"], got["params"],
                                     got["val"])  # fmt: skip
        got.pop("corpus", None)
        got["losses"] = [r.loss for r in got.pop("results")]
        out.append(got)
    return out


def _check(pairs: list[list[dict]], recompute: str, offload: str, zero: int, **layout) -> None:
    plain_cfg = _config(False, recompute, offload, zero, **layout)
    cfg = _config(True, recompute, offload, zero, **layout)
    est, plain_est = estimate(cfg), estimate(plain_cfg)
    place = "device" if offload == "none" else "host"
    for plain, part in pairs:
        assert plain["losses"] == part["losses"]
        for name, p in plain["params"].items():
            assert torch.equal(p, part["params"][name]), name
        calls, nbytes = gathers_per_step(cfg, part["pp_rank"])
        assert (part["gathers"][0], part["gathers"][2]) == (calls, nbytes), part["gathers"]
        assert calls > 0 and plain["gathers"] == (0, 0, 0)
        line, before = est.ranks[part["pp_rank"]], plain_est.ranks[plain["pp_rank"]]
        est_drop = getattr(before.line("activations"), place) - getattr(
            line.line("activations"), place
        )
        assert est_drop > 0
        # the estimate moves with the meter: its gap to it (tp's ends, the checkpoint's
        # dropout keys) is the same with and without partitioning
        assert plain["peaks"][place] - part["peaks"][place] == est_drop, (layout, recompute)


CASES2 = {
    "tp2 full": ("full", "none", {}),
    "tp2 selective": ("selective", "none", {}),
    "tp2 full offload": ("full", "cpu", {}),
    # RMSNorm in fp32 saves its input twice (square and product): one slice, one gather
    "tp2 selective llama offload": ("selective", "cpu", {"preset": "tiny-llama"}),
    # LoRA: block 0's input needs no gradient, so without full recompute nothing saves it
    "tp2 selective lora": ("selective", "none", {"lora_rank": 4}),
}


@pytest.mark.parametrize("case", list(CASES2))
def test_tp2_bitwise_exact_counted_and_metered(world2, case):
    recompute, offload, more = CASES2[case]
    pairs = world2.run(run_pair, recompute, offload, tp=2, **more)
    _check(pairs, recompute, offload, 0, tp=2, **more)


CASES4 = {
    "tp2 pp2 full": ("full", 0, {"tp": 2, "pp": 2, "n_layers": 4}),
    "tp2 pp2 zb-h1 selective": (
        "selective",
        0,
        {"tp": 2, "pp": 2, "n_layers": 4, "schedule": "zb-h1"},
    ),
    "tp2 dp2 zero2 full": ("full", 2, {"tp": 2, "dp": 2}),
    "tp2 dp2 zero2 selective": ("selective", 2, {"tp": 2, "dp": 2}),
}


@pytest.mark.parametrize("case", list(CASES4))
def test_world4_layouts_bitwise_exact_counted_and_metered(world4, case):
    recompute, zero, layout = CASES4[case]
    pairs = world4.run(run_pair, recompute, "none", zero, **layout)
    _check(pairs, recompute, "none", zero, **layout)


class _Two(nn.Module):
    """Two replicated-input layers, as a block with its input saved (x·w, then a norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, 8))
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x * self.w).tanh()


def grads_through_the_gather(recompute: bool) -> dict:
    """x's and the weights' gradients with and without partitioning, and the gathers."""
    mesh = build_mesh(Layout(tp=2), torch.device("cpu"), 60)
    comm = Comm(mesh)
    out = {}
    for partition in (False, True):
        torch.manual_seed(0)
        block, x0 = _Two(), torch.randn(3, 4, 8)
        if recompute:
            checkpoint_module(block)
        if partition:
            partition_module(block, comm)
        x = x0.clone().requires_grad_()
        y = x * 1.5  # x itself is a leaf: the block's input must come from a node
        comm.stats.begin_step(0)
        block(y).pow(2).sum().backward()
        out[partition] = (x.grad, [p.grad for p in block.parameters()],
                          comm.stats.total(op="all_gather", tag=TAG))  # fmt: skip
    return out


@pytest.mark.parametrize("recompute", [True, False])
def test_gradients_reach_the_block_input(world2, recompute):
    """The unpacked (gathered) input takes its place in the graph: the block input's and
    the weights' gradients equal the unpartitioned ones, with one gather per backward."""
    for got in world2.run(grads_through_the_gather, recompute):
        (gx, gw, none), (px, pw, gathers) = got[False], got[True]
        assert torch.equal(gx, px) and gx.abs().sum() > 0
        assert all(torch.equal(a, b) for a, b in zip(gw, pw, strict=True))
        assert none == (0, 0, 0) and gathers == (1, 3 * 4 * 8, 3 * 4 * 8 * 4)


def test_slices_gather_back_whole():
    """Without a world: a one-rank comm gathers its one part (the identity)."""
    t = torch.arange(24.0).view(2, 3, 4)
    mesh = build_mesh(Layout(), torch.device("cpu"), 60)
    comm = Comm(mesh)
    part = this_part(t, comm)
    assert part.data_ptr() != t.data_ptr()
    assert torch.equal(gather_whole(part, t.shape, comm), t)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp", "1"], "it needs tp > 1; got tp=1"),
        (["--tp", "2"], "it needs --recompute full or selective; got --recompute none"),
        (
            ["--tp", "2", "--recompute", "full", "--sequence-parallel"],
            "does not combine with --sequence-parallel (tp=2): sequence parallelism already "
            "holds the block inputs sharded over tp",
        ),
    ],
)
def test_refusals_are_one_line_exit_2(capsys, monkeypatch, flags, message):
    """Refused before any worker starts, in one line naming the values."""
    monkeypatch.setenv("COLUMNS", "40")  # a narrow terminal must not wrap the line
    assert main(["train", "--partition-activations", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.startswith("plait: error: ") and err.count("\n") == 1, err


def test_two_bw_refused_with_reason():
    cfg = small_config(pp=2, tp=2, accum=4, recompute="full", schedule="2bw")
    cfg.memory.partition_activations = True
    with pytest.raises(ConfigError, match="does not combine with --schedule 2bw"):
        cfg.validate()


def test_off_by_default_and_the_estimate_term_is_the_formula():
    """Off by default (no gathers); on, the estimate's activations drop by
    L·(1 - 1/t)·s·b·h·e and the gathers are L·m of s·b·h·e, from the config's own numbers."""
    off = small_config(tp=2, recompute="full", accum=2)
    assert off.memory.partition_activations is False and gathers_per_step(off) == (0, 0)
    on = small_config(tp=2, recompute="full", accum=2)
    on.memory.partition_activations = True
    m, t = on.model, on.train
    whole = t.seq_len * t.micro_batch * m.d_model * 4  # fp32
    drop = (estimate(off).ranks[0].line("activations").device
            - estimate(on).ranks[0].line("activations").device)  # fmt: skip
    assert drop == m.n_layers * (whole - whole // 2) > 0
    assert gathers_per_step(on) == (m.n_layers * 2, m.n_layers * 2 * whole)
