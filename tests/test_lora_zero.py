"""LoRA under the ZeRO engine: the frozen base is held, never trained, and the adapters train
exactly as one process trains them.

Parity (fp32): the single-process loop (reference.reference_run_named: the whole global
batch, torch's AdamW over the parameters that require grad) against the production Trainer
at dp=2 under ZeRO stages 1-3, CPU and NVMe offload, and full or selective recomputation;
and at tp2 x dp2 (stage 3) and pp2 x dp2 (stage 1). Losses every step at rtol 1e-5, every
adapter after the steps, the base unchanged; and an NF4 base (QLoRA) at tp2 x dp2 under
stage 3 against its one process (tests/nf4_parity.py). The embedding is frozen, so nothing requires
grad at a block's input: with reentrant checkpointing the adapters would get no gradient at
all. Every A and every B must have moved (B starts at zero, so A's gradient is zero on the
first step and only a second step moves it).

Stage 3 shards the base over dp and gathers it per unit (zero/frozen.py): its parameter
bytes per rank and the elements it gathers per step are checked against the single-process
sizes. Precision: under bf16 the base is held in `--base-dtype` (auto: bf16) while the
adapters keep fp32 masters; a base held in another dtype than the compute dtype is cast per
use. Memory: the tracker's model states are the frozen base plus the adapters' parameters,
gradients, masters and moments, byte for byte.
"""

from __future__ import annotations

import copy

import pytest
import torch

from nf4_parity import assert_same_run, nf4_run
from plait.build.model import build_model
from plait.config import Config
from plait.errors import ConfigError
from plait.memory_tracker import MemoryTracker
from plait.mesh import build_mesh
from plait.mixed_precision import parse_base_dtype
from plait.models.declare import is_adapter
from plait.parallel.tp.sharding import full_tensor, param_shard_specs
from plait.train import Trainer
from reference import corpus_for, reference_run_named, small_config
from sections import set_option

STEPS = 3
RTOL = 1e-5
_LEAVES = {  # tiny-gpt: q A+B, k and v B (they share q's A), o, fc1, fc2 A+B each
    "attn.wq": "ab", "attn.wk": "b", "attn.wv": "b", "attn.wo": "ab", "mlp.fc1": "ab",
    "mlp.fc2": "ab",
}  # fmt: skip
ADAPTERS = sorted(
    f"blocks.{i}.{leaf}.lora_{ab}"
    for i in range(2)
    for leaf, abs_ in _LEAVES.items()
    for ab in abs_
)


def lora_config(
    dp: int = 2, tp: int = 1, pp: int = 1, accum: int = 1, **parallel: object
) -> Config:
    """tiny-gpt with adapters on every Linear (GPT-2's fused qkv: one A shared by q, k, v)."""
    cfg = small_config(dp=dp, tp=tp, pp=pp, accum=accum, steps=STEPS)
    cfg.model.lora_rank, cfg.model.lora_targets = 4, "all"
    for key, value in parallel.items():
        set_option(cfg, "parallel", key, value)
    cfg.validate()
    return cfg


# ------------------------------------------------------------------ bad input (no processes)


def test_base_dtype_is_validated_with_one_line():
    one_line = r"^--base-dtype must be one of auto, fp32, bf16, fp16, nf4; got 'int8'$"
    with pytest.raises(ConfigError, match=one_line):
        parse_base_dtype("int8", "bf16", lora=True)
    cfg = small_config()
    cfg.lora.base_dtype = "bf16"
    with pytest.raises(ConfigError, match=r"--base-dtype bf16 is for a LoRA run's frozen base"):
        cfg.validate()
    cfg = lora_config(dp=1)
    cfg.lora.base_dtype = "fp8"
    with pytest.raises(ConfigError, match="got 'fp8'"):
        cfg.validate()
    cfg = lora_config(dp=2)
    cfg.parallel.dp_mode, cfg.lora.base_dtype = "naive", "bf16"
    with pytest.raises(ConfigError, match=r"^--base-dtype bf16 is held by the ZeRO engine only;"):
        cfg.validate()
    cfg.lora.base_dtype = "fp32"  # the precision's own dtype: what every engine does
    cfg.validate()
    assert parse_base_dtype("auto", "fp16", lora=False) == torch.float16
    assert parse_base_dtype("fp32", "bf16", lora=True) == torch.float32


# ------------------------------------------------------------------ multi-rank parity

CASES = [  # (zero stage, offload, recompute)
    (1, "none", "none"),
    (2, "cpu", "selective"),
    (3, "none", "full"),
    (3, "nvme", "none"),
    (1, "cpu", "full"),
]


def _run(cfg: Config, corpus) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The production Trainer's losses and its full parameters after the steps."""
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    trainer = Trainer(cfg, mesh, corpus)
    try:
        losses = [trainer.train_step().loss for _ in range(STEPS)]
        for p in trainer.engine.frozen.values():
            assert not p.requires_grad and p.grad is None
        memory = {
            "parameters": trainer.engine.memory.persistent("parameters"),
            "frozen_gathered": trainer.comm.stats.total("all_gather", "frozen")[1],
        }
        specs = param_shard_specs(trainer.model)  # tp shards, gathered whole
        with trainer.engine.unsharded():
            params = {
                n: full_tensor(p.detach().float(), specs[n], trainer.comm)
                if n in specs
                else p.detach().float().clone()
                for n, p in trainer.model.named_parameters()
            }
    finally:
        trainer.close()
    return losses, params, memory


def _stage3_figures(
    start: dict[str, torch.Tensor], n_layers: int, dp: int, accum: int
) -> dict[str, int]:
    """What stage 3 should hold and gather in fp32 at tp 1, from the single-process sizes:
    each unit (a block; the root: embedding, final norm, tied head) is padded to a multiple
    of dp and split; the base's units are gathered twice per micro-batch (its forward and
    its backward)."""

    def padded(block: int | None, adapters: bool) -> int:
        """Elements of one unit, frozen or adapters, padded to a multiple of dp."""
        prefix = "blocks." if block is None else f"blocks.{block}."
        count = sum(
            t.numel()
            for n, t in start.items()
            if n.startswith(prefix) != (block is None) and is_adapter(n) == adapters
        )
        return -(-count // dp) * dp

    frozen = [padded(b, False) for b in [*range(n_layers), None]]
    adapters = [padded(b, True) for b in range(n_layers)]
    return {
        "parameters": 4 * (sum(frozen) + sum(adapters)) // dp,
        "frozen_gathered": 2 * accum * sum(frozen),
    }


def _parity(layout: dict, cases: list[tuple[int, str, str]], folder: str) -> list[str]:
    """The single process once, then each case in `layout` (dp 2 and these tp, pp, accum);
    returns the names of the adapters this rank holds, each compared."""
    base = lora_config(dp=2, **layout)
    corpus = corpus_for(base)
    ref_losses, _, ref, _ = reference_run_named(base, corpus)  # one process, same batch
    first = build_model(base.model, torch.device("cpu"), base.train.seed)
    start = {n: p.detach().clone() for n, p in first.named_parameters(remove_duplicate=False)}
    for stage, offload, recompute in cases:
        cfg = copy.deepcopy(base)
        cfg.memory.zero, cfg.memory.offload, cfg.memory.recompute = stage, offload, recompute
        cfg.memory.offload_dir = f"{folder}/zero{stage}" if offload == "nvme" else None
        cfg.validate()
        losses, got, memory = _run(cfg, corpus)
        where = f"zero {stage} offload {offload} recompute {recompute} {layout}"
        if stage < 3:  # the base whole on every rank: never gathered
            assert memory["frozen_gathered"] == 0, where
        elif "tp" not in layout:  # sharded over dp, gathered per unit
            sizes = dict(first.named_parameters())  # a tied weight once
            figures = _stage3_figures(sizes, base.model.n_layers, 2, base.accumulation)
            assert memory == figures, where
        else:  # tp shards, sharded further over dp
            assert memory["frozen_gathered"] > 0, where
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL,
                                   atol=0.0, msg=lambda m, w=where: f"{w}: {m}")  # fmt: skip
        adapters = [n for n in got if is_adapter(n)]
        for name in got:
            if is_adapter(name):  # trained as one process trains it, and moved
                what = f"{where} {name}"
                torch.testing.assert_close(got[name], ref[name], rtol=RTOL, atol=1e-6,
                                           msg=lambda m, w=what: f"{w}: {m}")  # fmt: skip
                assert not torch.equal(got[name], start[name]), f"{where}: {name} never moved"
            else:  # frozen: exactly its initial value
                assert torch.equal(got[name], start[name]), f"{where}: base {name} changed"
    return sorted(adapters)


def test_zero_stages_offload_and_recompute_equal_one_process(world2, tmp_path):
    held = world2.run(_parity, {"accum": 2}, CASES, str(tmp_path), timeout=300)
    assert held[0] == held[1] == ADAPTERS


def _mixed(cases: list[tuple[int, str, str]]) -> None:
    """dp 2 in 16-bit precisions, the base held in `--base-dtype`: the run of one process
    up to 16-bit rounding, the base held in its dtype, sharded under stage 3."""
    base = lora_config(dp=2)
    corpus = corpus_for(base)
    ref_losses, _, _, _ = reference_run_named(base, corpus)
    for stage, precision, base_dtype in cases:
        cfg = copy.deepcopy(base)
        cfg.memory.zero, cfg.train.precision = stage, precision
        cfg.lora.base_dtype, cfg.memory.offload = base_dtype, "cpu"
        cfg.validate()
        trainer = _single(cfg, corpus)
        try:
            losses = [trainer.train_step().loss for _ in range(STEPS)]
            held = parse_base_dtype(base_dtype, precision, lora=True)
            assert {p.dtype for p in trainer.engine.frozen.values()} == {held}
            gathered = trainer.comm.stats.total("all_gather", "frozen")[1]
            assert (gathered > 0) == (stage == 3), (stage, gathered)
        finally:
            trainer.close()
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0
        )


def test_mixed_precision_base_dtypes_under_zero(world2):
    world2.run(_mixed, [(3, "bf16", "fp32"), (3, "fp16", "auto"), (2, "bf16", "auto")])


def test_tensor_and_pipeline_parallel_zero_equal_one_process(world4, tmp_path):
    """tp2 x dp2 under stage 3: A and B split as their base (models/declare.py), the shards
    over dp. pp2 x dp2 under stage 1 with CPU offload: the tied embedding, frozen, is in no
    group on either end (the engine isolates only trainable copies)."""
    held = world4.run(_parity, {"tp": 2}, [(3, "none", "full")], str(tmp_path), timeout=300)
    assert held == [ADAPTERS] * 4
    pp = {"pp": 2, "accum": 2}
    held = world4.run(_parity, pp, [(1, "cpu", "selective")], str(tmp_path), timeout=300)
    assert sorted({name for names in held for name in names}) == ADAPTERS
    assert len({tuple(names) for names in held}) == 2  # each stage its own blocks' adapters


# ------------------------------------------------------------------ precision and memory


def _single(cfg: Config, corpus) -> Trainer:
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), cfg.parallel.comm_timeout)
    return Trainer(cfg, mesh, corpus)


@pytest.mark.parametrize(
    ("precision", "base", "held"),
    [
        ("bf16", "auto", torch.bfloat16),
        ("fp32", "bf16", torch.bfloat16),  # a narrower base than the compute: cast per use
    ],  # a wider one, and fp16: test_mixed_precision_base_dtypes_under_zero
)
def test_base_held_in_base_dtype_adapters_keep_fp32_masters(precision, base, held):
    cfg = lora_config(dp=1, precision=precision, base_dtype=base)
    corpus = corpus_for(cfg)
    ref_losses, _, _, _ = reference_run_named(cfg, corpus)
    trainer = _single(cfg, corpus)
    try:
        engine = trainer.engine
        assert engine.frozen and {p.dtype for p in engine.frozen.values()} == {held}
        assert not any(is_adapter(n) for n in engine.frozen)
        compute = engine.precision.param_dtype
        assert {p.dtype for g in engine.groups for p in g.params} == {compute}
        masters = [c.tensors["master"] for c in engine.states.chunks()]
        assert masters and {m.dtype for m in masters} == {torch.float32}
        losses = [trainer.train_step().loss for _ in range(STEPS)]
        with torch.no_grad():  # the model computes in the precision's dtype, whatever the base
            assert trainer.model(torch.zeros(1, 8, dtype=torch.long)).dtype == compute
    finally:
        trainer.close()
    # 16-bit rounding of the base or the compute only: the same run, not another one
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)


def _numel(params, adapters: bool) -> int:
    return sum(p.numel() for n, p in params.items() if is_adapter(n) == adapters)


@pytest.mark.parametrize(("base", "base_bytes"), [("auto", 2), ("fp32", 4)])
def test_model_states_are_the_base_plus_the_adapters_states(base, base_bytes):
    """bf16, stage 0, one rank: the base in its dtype; each adapter element 2 (bf16 copy)
    + 2 (bf16 gradient) + 4 (fp32 master) + 8 (Adam's two moments) = 16 bytes."""
    cfg = lora_config(dp=1, precision="bf16", base_dtype=base)
    full = dict(build_model(cfg.model, torch.device("cpu"), 0).named_parameters())
    frozen, adapters = _numel(full, False), _numel(full, True)
    # tiny-gpt (h 64, ffn 256, 2 blocks, tied head), rank 4 on every Linear. Base: tokens
    # 256h + positions 64h + per block 4 norm vectors 4h, q/k/v/o 4(h^2 + h), fc1 and fc2
    # 2 * 256h + 256 + h; final norm 2h. Adapters per block: q A+B 2rh, k and v B 2rh
    # (A shared), o 2rh, fc1 and fc2 2r(h + 256).
    assert (frozen, adapters) == (120_576, 8_192)
    trainer = _single(cfg, corpus_for(cfg))
    try:
        trainer.train_step()
        memory = trainer.engine.memory
        assert memory.persistent("parameters") == base_bytes * frozen + 2 * adapters
        assert memory.persistent("gradients") == 2 * adapters
        assert memory.persistent("master_weights") == 4 * adapters
        assert memory.persistent("optimizer_states") == 8 * adapters
        assert memory.model_state_bytes() == base_bytes * frozen + 16 * adapters
    finally:
        trainer.close()


def test_activation_meter_skips_a_frozen_weight():
    """A Linear saves its weight for the input's gradient: a frozen base weight is a
    parameter, not an activation (only the input, made by this forward, counts)."""
    layer = torch.nn.Linear(8, 16)
    layer.requires_grad_(False)
    leaf = torch.randn(4, 8, requires_grad=True)
    tracker = MemoryTracker()
    with tracker.activations():
        x = leaf.tanh()  # saved by tanh for its backward: 4 x 8 fp32
        layer(x).sum().backward()
        assert tracker.peak("activations") == 4 * 8 * 4


def test_nf4_base_at_tp2_dp2_zero3_equals_one_process(world4):
    """QLoRA at tp2 x dp2 under ZeRO-3 (tests/nf4_parity.py): each rank holds its tp slice of
    every NF4 weight (whole 64-blocks), sharded over dp, and gathers its slice's packed bytes
    per block: half of what tp=1 gathers (tests/test_nf4_layouts.py), the same run."""
    out = world4.run(nf4_run, tp=2, dp=2, zero=3, sequence_parallel=True, accum=1, timeout=300)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = nf4_run(micro=2, accum=2)
    finally:
        torch.set_num_threads(threads)
    h, f, kv = 128, 512, 64
    weights = [h * h, h * kv, h * kv, h * h, h * f, h * f, h * f]  # one block's Linears
    packed = sum(n // 2 + n // 64 for n in weights)  # codes and absmax codes of a block
    for rank in out:
        assert_same_run(rank, want)
        assert rank["gathered"]["nf4"] == 2 * 2 * packed // 2  # fwd + bwd, 2 blocks, tp half
    assert len({r["params"] for r in out}) == 1 and out[0]["params"] < 0.4 * want["params"]
