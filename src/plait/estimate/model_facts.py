"""What a planner's thousands of layouts of one model share: the facts that depend only on
the model, the tensor-parallel degree and the pipeline cut (and the ZeRO groups on the stage
and bucket size), computed once per search.

A layout's estimate and its step time read the model's contract (`models/declare.describe`),
its tp rank's shards (`rank_params.tp_contract`), each pipeline rank's parameter list
(`rank_params.rank_params`), the elements summed over tp (`rank_params.tp_partial_elements`)
and the model's totals. None of these depends on the ZeRO stage, offload, recomputation,
micro-batch or dp degree, which is what most layouts of one search differ by; building them
for every layout was most of a large plan's time. `ModelFacts` keeps them for one model: the
search owns one (in `plan/step_time.Memo`), a single estimate makes a fresh one, and the
figures are the same either way (the lists are shared, never changed by their readers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from plait.estimate.model_states import group_units
from plait.estimate.rank_params import (
    ParamSpec,
    rank_params,
    total_parameters,
    tp_contract,
    tp_partial_elements,
)
from plait.models.architecture import ModelConfig
from plait.models.contract import ModelContract
from plait.models.transformer import layer_forward_flops_per_token
from plait.schedule.stages import StagePlan, rank_plans


def cut(plans: list[StagePlan]) -> tuple:
    """A pipeline rank's stages as a key: each one's global index, layers and ends."""
    return tuple((p.stage, p.layers.start, p.layers.stop, p.first, p.last) for p in plans)


@dataclass
class ModelFacts:
    """One model's facts by tp degree and pipeline cut, each computed on first use."""

    model: ModelConfig
    _splits: dict[int, ModelContract] = field(default_factory=dict)
    _params: dict[tuple, list[ParamSpec]] = field(default_factory=dict)
    _partial: dict[tuple, int] = field(default_factory=dict)
    _totals: dict[bool | None, int] = field(default_factory=dict)
    _layer_flops: dict[int, int] = field(default_factory=dict)
    _plans: dict[tuple, list[StagePlan]] = field(default_factory=dict)
    _units: dict[tuple, list[list[ParamSpec]]] = field(default_factory=dict)

    def split(self, tp: int) -> ModelContract:
        """`tp_contract(model, tp)`."""
        if tp not in self._splits:
            self._splits[tp] = tp_contract(self.model, tp)
        return self._splits[tp]

    def rank_params(self, tp: int, plans: list[StagePlan]) -> list[ParamSpec]:
        """`rank_params(tp_contract(model, tp), plans)`; the list is shared: read it only."""
        key = (tp, cut(plans))
        if key not in self._params:
            self._params[key] = rank_params(self.split(tp), plans)
        return self._params[key]

    def rank_plans(
        self, pp: int, v: int, rank: int, sizes: Sequence[int] | None
    ) -> list[StagePlan]:
        """`rank_plans(model.n_layers, pp, v, rank, sizes)`; the list is shared."""
        key = (pp, v, rank, None if sizes is None else tuple(sizes))
        if key not in self._plans:
            self._plans[key] = rank_plans(self.model.n_layers, pp, v, rank, sizes)
        return self._plans[key]

    def group_units(
        self, tp: int, plans: list[StagePlan], zero: int, bucket_mb: float
    ) -> list[list[ParamSpec]]:
        """`group_units(self.rank_params(tp, plans), zero, bucket_mb)`; shared."""
        key = (tp, cut(plans), zero, bucket_mb)
        if key not in self._units:
            self._units[key] = group_units(self.rank_params(tp, plans), zero, bucket_mb)
        return self._units[key]

    def tp_partial_elements(self, plans: list[StagePlan], sp: bool) -> int:
        """`tp_partial_elements(model, plans, sp)`."""
        key = (sp, cut(plans))
        if key not in self._partial:
            self._partial[key] = tp_partial_elements(self.model, plans, sp)
        return self._partial[key]

    def total_parameters(self, trainable: bool | None = None) -> int:
        """`total_parameters(model, trainable)`."""
        if trainable not in self._totals:
            self._totals[trainable] = total_parameters(self.model, trainable)
        return self._totals[trainable]

    def layer_flops(self, seq_len: int) -> int:
        """`layer_forward_flops_per_token(model, seq_len)`."""
        if seq_len not in self._layer_flops:
            self._layer_flops[seq_len] = layer_forward_flops_per_token(self.model, seq_len)
        return self._layer_flops[seq_len]


def facts_for(model: ModelConfig, facts: ModelFacts | None) -> ModelFacts:
    """`facts` where they are `model`'s, else a fresh record (a caller's cache never answers
    for another model)."""
    if facts is not None and (facts.model is model or facts.model == model):
        return facts
    return ModelFacts(model)
