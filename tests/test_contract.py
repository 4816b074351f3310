"""The model contract (models/contract.py, models/declare.py), without processes.

Each check builds the real model on the meta device and parallelizes it as a rank would (a
Mesh is plain data: tensor parallelism and the pipeline split run without a process group
on meta), then compares what the contract says with the modules' parameters.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from plait.comm import Comm
from plait.errors import ConfigError
from plait.estimate.rank_params import rank_params, tp_contract
from plait.mesh import Mesh
from plait.models.architecture import ModelConfig
from plait.models.block_table import block_table
from plait.models.contract import contract_of
from plait.models.hf.mapping import block_pieces
from plait.models.init import init_value
from plait.models.presets import get_preset
from plait.models.transformer import Transformer
from plait.parallel.activation_recompute import apply_recompute
from plait.parallel.grads import (
    SplitGradRules,
    tied_embedding_params,
    tp_partial_params,
    tp_replicated_params,
)
from plait.parallel.pipeline.stage import prune_to_stages
from plait.parallel.tp.apply import apply_tensor_parallel, block_plan
from plait.parallel.zero.layout import block_units, build_groups
from plait.schedule.stages import rank_plans
from plait.topology import Layout

SRC = Path(__file__).resolve().parents[1] / "src" / "plait"


def _cfg(name: str, tied: bool) -> ModelConfig:
    # 257 tokens: the vocabulary splits unevenly, so the last tp rank holds padding rows.
    return replace(get_preset(name), tie_embeddings=tied, vocab_size=257)


MODELS = [("tiny-gpt", True), ("tiny-gpt", False), ("tiny-llama", False), ("tiny-llama", True)]


def _mesh(tp: int = 1, pp: int = 1, rank: int = 0) -> Mesh:
    """This rank's Mesh as data (tp fastest); 'pp_ends' named as mesh.py builds it."""
    layout = Layout(pp=pp, tp=tp)
    line = layout.axis_ranks("pp", rank)
    return Mesh(layout, rank, torch.device("cpu"), group_ranks={"pp_ends": [line[0], line[-1]]})


def _rank_model(cfg: ModelConfig, tp: int, pp: int, rank: int, sp: bool = False) -> Transformer:
    """Rank `rank`'s model on meta, parallelized as the trainer does it: tp, then the pipeline."""
    mesh = _mesh(tp, pp, rank)
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_tensor_parallel(model, mesh, Comm(mesh), sequence_parallel=sp)
    if pp > 1:
        prune_to_stages(model, rank_plans(cfg.n_layers, pp, 1, mesh.coord.pp))
    return model


@pytest.mark.parametrize(("name", "tied"), MODELS)
def test_the_description_is_the_single_process_model(name: str, tied: bool) -> None:
    cfg = _cfg(name, tied)
    with torch.device("meta"):
        model = Transformer(cfg)
    c = model.contract
    assert [p.path for p in c.parts] == ["embed", "blocks.0", "blocks.1", "norm", "head"]
    assert [e.name for e in c.params()] == [n for n, _ in model.named_parameters()]
    assert all(e.decl.shard is None and e.decl.trainable for e in c.params())
    assert (model.head.weight is model.embed.tok.weight) == tied
    assert c.canonical("head.weight") == ("embed.tok.weight" if tied else "head.weight")
    assert c.canonical("blocks.1.attn.wq.weight") == "blocks.1.attn.wq.weight"
    assert c.split_ties() == frozenset()  # one process holds both ends
    partial = {e.name for e in c.params() if e.decl.sp_partial}  # per position, replicated
    norms = {n for n, _ in model.named_parameters() if n.split(".")[-2].endswith("norm")}
    row_biases = {f"blocks.{i}.{w}.bias" for i in range(2) for w in ("attn.wo", "mlp.fc2")}
    pos = {"embed.pos.weight"} if cfg.pos == "learned" else set()
    assert partial == norms | (row_biases if cfg.bias else set()) | pos


@pytest.mark.parametrize(("name", "tied"), MODELS)
@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_declares_the_shards_the_layers_hold(name, tied, sp) -> None:
    cfg = _cfg(name, tied)
    for rank in range(2):
        model = _rank_model(cfg, tp=2, pp=1, rank=rank, sp=sp)
        c = contract_of(model)
        shards = c.shards()
        dims = {n.split(".", 2)[-1]: s.dim for n, s in shards.items() if n.startswith("blocks.1")}
        mlp = ("w_gate", "w_up", "w_down") if cfg.mlp == "swiglu" else ("fc1", "fc2")
        expected = {f"attn.{w}.weight": 0 for w in ("wq", "wk", "wv")} | {"attn.wo.weight": 1}
        expected |= {f"mlp.{w}.weight": 0 for w in mlp[:-1]} | {f"mlp.{mlp[-1]}.weight": 1}
        if cfg.bias:  # column-parallel biases split with their outputs; row biases replicate
            expected |= {f"attn.{w}.bias": 0 for w in ("wq", "wk", "wv")}
            expected |= {f"mlp.{w}.bias": 0 for w in mlp[:-1]}
        assert dims == expected
        vocab = shards["embed.tok.weight"]
        assert (vocab.dim, vocab.global_shape, vocab.offsets) == (0, (257, 64), (129 * rank, 0))
        assert vocab.padding == rank  # 257 rows: 129 + 128 real, one row of padding last
        if tied:  # the head is the embedding's shard, named once
            assert "head.weight" not in shards and model.head.weight is model.embed.tok.weight
        else:
            assert shards["head.weight"] == vocab
        params = dict(model.named_parameters())
        assert {n: tuple(params[n].shape) for n in shards} == {
            n: s.shape for n, s in shards.items()
        }
        partial = {n for n, p in params.items() if any(p is q for q in _partial(model))}
        assert partial == ({e.name for e in c.params() if e.decl.sp_partial} if sp else set())
        replicated = {id(p) for p in tp_replicated_params(model)}
        assert {n for n, p in params.items() if id(p) in replicated} == params.keys() - shards


def _partial(model: nn.Module) -> list[nn.Parameter]:
    return tp_partial_params(model)


@pytest.mark.parametrize(("name", "tied"), MODELS)
def test_pruning_to_a_stage_keeps_its_parts_and_the_tied_copies(name: str, tied: bool) -> None:
    cfg = _cfg(name, tied)
    for rank in range(4):  # tp 2 x pp 2: tp fastest
        model = _rank_model(cfg, tp=2, pp=2, rank=rank, sp=True)
        c, first = contract_of(model), rank < 2
        assert [p.path for p in c.held_parts()] == (
            ["embed", "blocks.0"] if first else ["blocks.1", "norm", "head"]
        )
        assert [e.name for e in c.params()] == [n for n, _ in model.named_parameters()]
        end = "embed.tok.weight" if first else "head.weight"
        assert c.split_ties() == ({end} if tied else set())
        copies = tied_embedding_params(model)
        assert copies == ([model.get_parameter(end)] if tied else [])
        assert c.canonical(end) == ("embed.tok.weight" if tied else end)
        rules = SplitGradRules.of(model, _mesh(2, 2, rank))
        assert rules.tied == {id(p) for p in copies}
        last_copy = {id(p) for p in copies} if not first else set()
        tp_rank_0 = rank % 2 == 0
        others = set() if tp_rank_0 else {id(p) for p in tp_replicated_params(model)}
        assert rules.uncounted == last_copy | others
        assert rules.partial == {id(p) for p in _partial(model)} != set()


@pytest.mark.parametrize(("name", "tied"), MODELS)
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_the_estimator_lists_what_a_rank_holds(name: str, tied: bool, tp: int, pp: int) -> None:
    """`rank_params` (pure, from the config) against the parallelized model's parameters."""
    cfg = _cfg(name, tied)
    split = tp_contract(cfg, tp)
    for stage in range(pp):
        model = _rank_model(cfg, tp, pp, rank=stage * tp)
        specs = rank_params(split, rank_plans(cfg.n_layers, pp, 1, stage))
        params = list(model.named_parameters())
        assert [(s.name, s.numel) for s in specs] == [(n, p.numel()) for n, p in params]
        alone = {id(p) for p in tied_embedding_params(model)} if pp > 1 else set()
        assert [s.isolated for s in specs] == [id(p) in alone for _, p in params]
        partial = [e.decl.sp_partial for e in contract_of(model).params()]
        assert [s.sp_partial for s in specs] == partial
        blocks = [None if s.block is None else f"blocks.{s.block}." for s in specs]
        assert all(b is None or n.startswith(b) for b, (n, _) in zip(blocks, params, strict=True))


def test_recomputation_is_recorded_for_the_blocks_a_rank_holds() -> None:
    cfg = _cfg("tiny-llama", False)
    for mode, expected in (("full", {1}), ("selective", set()), ("none", set())):
        model = _rank_model(cfg, tp=1, pp=2, rank=1)
        apply_recompute(model, mode)
        assert model.contract.recomputed == expected


def test_frozen_parameters_get_no_group_and_train_nothing() -> None:
    """Frozen is free: one declaration, and the engines' groups leave the parameter out."""
    with torch.device("meta"):
        model = Transformer(_cfg("tiny-llama", False))
    frozen = ["blocks.0.attn.wq.weight", "head.weight"]
    model.set_contract(model.contract.freezing(frozen))
    params = dict(model.named_parameters())
    assert [n for n, p in params.items() if not p.requires_grad] == frozen
    assert model.contract.blocks()[1].params is model.contract.parts[2].params  # still shared
    for stage in (0, 3):
        grouped = [n for g in build_groups(model, stage, 1 << 20, 0, 2) for n in g.names]
        assert sorted(grouped) == sorted(params.keys() - set(frozen))
    assert all(p.requires_grad for unit in block_units(model) for p in unit)
    with pytest.raises(KeyError, match=r"blocks\.9\.attn\.wq\.weight"):
        model.contract.freezing(["blocks.9.attn.wq.weight"])


def test_an_undeclared_parameter_is_refused() -> None:
    with torch.device("meta"):
        model = Transformer(_cfg("tiny-gpt", True))
    model.blocks[0].attn.wq.adapter = nn.Parameter(torch.zeros(2, 64))
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.wq\.adapter"):
        model.set_contract(model.contract)
    with pytest.raises(ConfigError, match="Linear declares no model contract"):
        contract_of(nn.Linear(2, 2))


def _probes(folders: tuple[str, ...], probes: re.Pattern) -> list[str]:
    return [
        f"{path.relative_to(SRC)}:{i}: {line.strip()}"
        for folder in folders
        for path in sorted((SRC / folder).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if probes.search(line)
    ]


def test_parallel_code_does_not_probe_the_model() -> None:
    """Parallel code and checkpoints learn about the model from its contract only."""
    probes = re.compile(r"\bhasattr\(|\bgetattr\(|param_shards|tp_partial_grads|\b_parameters\b")
    assert _probes(("parallel", "checkpoint"), probes) == []


def test_the_model_does_not_probe_what_parallelism_made_of_it() -> None:
    """The model, its declarations and its rules learn what a layer is from the block table
    and the contract, never by looking for attributes (a parallelized head's `region_input`
    or `gather_output`, an adapter's `lora_b`). A tokenizer's optional vocabulary size
    (models/generate.py) is no part of the model."""
    probes = re.compile(r"\bhasattr\(|\bgetattr\((?!tokenizer\b)|\b_parameters\b")
    assert _probes(("models",), probes) == []


@pytest.mark.parametrize(("name", "tied"), MODELS)
def test_every_reader_of_the_block_follows_its_table(name: str, tied: bool) -> None:
    """The block table (models/block_table.py) against what each reader derives from it: the
    model's Linears (widths, bias), the declared split of every weight and adapter, the tp
    plan's styles, the init's residual scaling and the Hugging Face names."""
    cfg = replace(_cfg(name, tied), lora_rank=4, lora_targets="all")
    table = block_table(cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    decls = {d.leaf: d for d in model.contract.parts[1].params}
    plan = block_plan(cfg, sequence_parallel=False)
    hf = block_pieces(cfg, "")
    for row in table.linears:
        layer = model.blocks[0].get_submodule(row.path)
        assert (layer.out_features, layer.in_features) == row.widths(cfg)
        assert (layer.bias is not None) == row.has_bias(cfg) == (f"{row.path}.bias" in decls)
        column = row.style == "column"
        assert decls[f"{row.path}.weight"].split_dim == (0 if column else 1)
        assert decls[f"{row.path}.lora_b"].split_dim == (0 if column else None)
        a = decls.get(f"{row.path}.lora_a")
        assert a is None or a.split_dim == (None if column else 1)
        assert (a is None) == (table.fused(row.path)[0].path != row.path)  # GPT-2's k, v
        assert plan[row.path].__name__ == ("colwise" if column else "rowwise")
        assert hf[f"{row.path}.weight"].hf_name == f"{row.hf}.weight"
        std = init_value(cfg, f"blocks.0.{row.path}.weight", (256, 256), 0).std().item()
        assert abs(std - (0.01 if row.residual else 0.02)) < 0.02 * 0.05, row.path
    entered = {path for path, style in plan.items() if style.__name__ == "enter"}
    assert entered == {r.sublayer for r in table.linears if r.style == "column"}
