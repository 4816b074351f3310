"""`estimate(cfg) -> Estimate`: every byte one rank of each pipeline stage holds, predicted.

Pure: the parameters are counted from the config (`rank_params.py`), the flat groups formed as the
ZeRO engine forms them (`model_states.py`), activations summed site by site (`activations.py`) and
multiplied by what the pipeline schedule keeps in flight (the plan's `peak_held`), buffers
from the engine's limits (`buffers.py`). No process, no tensor, no model: a planner can call
it for thousands of layouts.

Ranks of one pipeline stage differ only in which shard they hold, not in its size (tp shards
and ZeRO shards are equal, padding included), so one `RankEstimate` per stage is the most
loaded rank of that stage.
"""

from __future__ import annotations

from plait.config import Config
from plait.data.examples import is_examples_dir
from plait.device import device_kind
from plait.errors import ConfigError
from plait.estimate import activations as act
from plait.estimate.adapters import down_input_bytes, lora_head_bytes, lora_layer_bytes
from plait.estimate.buffers import (
    buffer_lines,
    frozen_units,
    pipeline_buffers,
    receive_buffers,
    zero_units,
)
from plait.estimate.formulas import (
    mixed_precision_adam_bytes,
    sixteen_bit_finetune_bytes,
    zero_model_state_bytes,
)
from plait.estimate.frozen_base import (
    FrozenBase,
    base_total_bytes,
    dequantized_bytes,
    frozen_base,
    frozen_line,
)
from plait.estimate.lines import LESSON_ORDER, PLACES, Estimate, Line, RankEstimate
from plait.estimate.model_facts import ModelFacts, facts_for
from plait.estimate.model_states import (
    ADAM_STATES,
    FP32,
    ElementBytes,
    States,
    model_states,
)
from plait.estimate.partitioned import block_saving, is_partitioned
from plait.estimate.peak import Walk, moments, positions
from plait.estimate.rank_params import padded_vocab
from plait.estimate.two_bw import Stream, two_bw_moments, two_bw_streams
from plait.mixed_precision import parse_precision
from plait.models.packed_attention import attention_path
from plait.schedule.actions import Schedule
from plait.schedule.schedules import build_schedule
from plait.schedule.simulate import peak_by_chunk
from plait.schedule.stages import StagePlan


def estimate(
    cfg: Config, schedule: Schedule | None = None, facts: ModelFacts | None = None
) -> Estimate:
    """Memory per rank of every pipeline stage for `cfg` (validated by the caller).

    `schedule`: the pipeline schedule to count in-flight activations on, when the caller
    already built it (a planner builds each once; its in-flight peak stops growing after a
    few times p micro-batches for every schedule but gpipe); by default the config's own.
    `facts`: the model's facts a planner keeps across layouts (`model_facts.py`)."""
    par, m = cfg.parallel, cfg.model
    if par.dp_mode != "ddp":
        raise ConfigError(
            f"the estimator models dp_mode ddp; dp_mode {par.dp_mode} (rank 0 alone holds the "
            "optimizer and the gathered logits) is measured by `plait train`, not estimated"
        )
    sizes = par.stage_layer_counts()
    schedule = schedule or _schedule(cfg)
    facts = facts_for(m, facts)
    streams = two_bw_streams(par.pp, cfg.accumulation) if par.two_bw else None
    ranks = tuple(
        _rank(
            cfg,
            facts,
            r,
            facts.rank_plans(par.pp, par.virtual_stages, r, sizes),
            schedule,
            streams[r] if streams else None,
        )
        for r in range(par.pp)
    )
    psi = facts.total_parameters(None if m.lora is None else False)
    return Estimate(psi, ranks, _reference(cfg, facts))


def _schedule(cfg: Config) -> Schedule | None:
    par = cfg.parallel
    if par.pp == 1:
        return None
    name = "1f1b" if par.two_bw else par.schedule  # 2BW streams 1F1B's order
    return build_schedule(name, par.pp, cfg.accumulation, par.virtual_stages)


def _shape(cfg: Config) -> act.MicroShape:
    """The micro-batch's symbols; packed when the run reads instruction data (an examples
    folder: packed or padded, its rows carry segments), attended as `packed_path` says."""
    par, t = cfg.parallel, cfg.train
    e = ElementBytes.of_run(cfg).param
    packed = is_examples_dir(cfg.data.path)
    if par.cp > 1:  # a rank's s/cp tokens, positions per token, attention by its exchange
        return act.MicroShape(t.micro_batch, t.seq_len // par.cp, par.tp, par.sequence_parallel, e,
                         True, "mask", par.cp, par.cp_exchange)  # fmt: skip
    return act.MicroShape(t.micro_batch, t.seq_len, par.tp, par.sequence_parallel, e, packed,
                     packed_path(cfg))  # fmt: skip


def packed_path(cfg: Config) -> str:
    """The path packed rows' attention takes in training (models/packed_attention.py): the
    mode, `auto` resolved on the run's device and compute dtype, the mask under dropout."""
    t = cfg.train
    dtype = parse_precision(t.precision, t.reduce_dtype, cfg.lora.base_upcast).param_dtype
    device = device_kind(cfg.train.device)
    return attention_path(cfg.train.packed_attention, device, dtype, cfg.model.dropout > 0)


def chunk_activation_bytes(cfg: Config, plan: StagePlan) -> int:
    """One micro-batch's saved bytes on one chunk (a pipeline stage's layers and ends)."""
    return sum(chunk_activation_places(cfg, plan))


def chunk_activation_places(cfg: Config, plan: StagePlan) -> tuple[int, int]:
    """(device, host) saved bytes of one micro-batch on one chunk: under activation offload
    the blocks' go to the host (a received input, a leaf, stays) and the ends' stay."""
    pieces = chunk_activation_pieces(cfg, plan)
    return sum(p[0] for p in pieces), sum(p[1] for p in pieces)


def chunk_activation_pieces(cfg: Config, plan: StagePlan) -> list[tuple[int, int, int]]:
    """(device, host, early) saved bytes of one micro-batch on one chunk, piece by piece in
    the order its backward frees them: the head and loss (last stage), each block from the
    last, the embedding (first stage); a block's under activation offload on the host.
    `early`: the device bytes a piece frees before its first gradient arrives. Packed rows'
    mask (`act.mask_bytes`) is freed with the chunk's first block; under activation offload
    each block makes its own host copy of it."""
    m, x, mode = cfg.model, _shape(cfg), cfg.memory.recompute
    offload = cfg.memory.offload_activations != "none"
    plain = m.lora is None  # LoRA's first gradients (an adapter's B) free next to nothing
    pieces = []
    if plan.last:
        head = act.head_bytes if plain else lora_head_bytes
        early = act.head_first_freed_bytes(m, x) if plain else 0
        pieces.append((head(m, x, padded_vocab(m, x.t) // x.t), 0, early))
    early = act.first_freed_bytes(m, x, mode) if plain and not offload else 0
    saving = block_saving(cfg, x)
    mask = act.mask_bytes(m, x, mode)
    inner = _layer_bytes(cfg, x)  # every block's but block 0's (its input needs no gradient)
    for i in reversed(plan.layers):
        block = inner if i > 0 else _layer_bytes(cfg, x, False)
        block += mask if offload or i == plan.layers[0] else 0
        if i == plan.layers[0] and not plan.first:
            block -= act.received_input_bytes(m, x, mode)
        if is_partitioned(cfg, plan, i):  # --partition-activations (partitioned.py)
            block -= saving
        if offload and mode == "full":  # the checkpoint saves the dropout keys: a host copy
            block += x.b * act.INDEX
        pieces.append((0, block, 0) if offload else (block, 0, early))
    if plan.first:  # a frozen embedding (LoRA) saves nothing
        pieces.append((act.embedding_bytes(m, x) if plain else 0, 0, 0))
    return pieces


def _layer_bytes(cfg: Config, x: act.MicroShape, grad_in: bool = True) -> int:
    """One block's saved bytes; under LoRA block 0's input (`grad_in` False) needs no
    gradient (estimate/adapters.py)."""
    m, mode = cfg.model, cfg.memory.recompute
    if m.lora is None:
        return act.layer_bytes(m, x, mode)
    return lora_layer_bytes(m, x, mode, grad_in)


def _rank(
    cfg: Config,
    facts: ModelFacts,
    r: int,
    plans: list[StagePlan],
    schedule: Schedule | None,
    stream: Stream | None = None,
) -> RankEstimate:
    par = cfg.parallel
    prec = ElementBytes.of_run(cfg)
    params = facts.rank_params(par.tp, plans)
    units = facts.group_units(par.tp, plans, cfg.memory.zero, par.bucket_mb)
    states = model_states(
        params, cfg.memory.zero, par.dp, prec, cfg.memory.offload, par.bucket_mb, units
    )
    grad_set = 0
    if par.two_bw:  # two weight versions, plain fp32 Adam (WeightVersions)
        grad_set = _two_bw_states(states)
    pieces = [chunk_activation_pieces(cfg, plan) for plan in plans]
    places = [(sum(p[0] for p in ps), sum(p[1] for p in ps)) for ps in pieces]
    if schedule is None:
        held, host, in_flight = places[0][0], places[0][1], 1
    else:
        split = schedule.split_backward
        held = peak_by_chunk(schedule, r, [p[0] for p in places], split)
        host = peak_by_chunk(schedule, r, [p[1] for p in places], split)
        in_flight = peak_by_chunk(schedule, r, [1] * len(places))
    lines = _state_lines(states, cfg, prec)
    base: FrozenBase | None = None
    if cfg.model.lora is not None:  # the frozen base (estimate/frozen_base.py)
        base = frozen_base(params, cfg, prec)
        lines.append(frozen_line(base, cfg))
    lines.append(_activation_line(cfg, plans, held, host, in_flight))
    walk = _walk(cfg, plans, pieces, params, held, states, prec, base, schedule, r)
    at = moments(walk)
    lines += buffer_lines(walk, at)
    if stream is not None:  # 2BW's moments: gradient sets come and go (estimate/two_bw.py)
        at = two_bw_moments(stream, places[0][0], grad_set, walk.receive)
    layers = tuple(i for plan in plans for i in plan.layers)
    held_params = sum(p.numel for p in params)
    return RankEstimate(r, layers, held_params, in_flight, tuple(lines), at)


def _walk(
    cfg: Config,
    plans: list[StagePlan],
    chunk_pieces: list[list[tuple[int, int, int]]],
    params: list,
    held: int,
    states: States,
    prec: ElementBytes,
    base: FrozenBase | None,
    schedule: Schedule | None,
    r: int,
) -> Walk:
    """This rank's backward, position by position (`estimate/peak.py`): the activations
    each position frees (the last chunk's micro-batch: the one whose backward comes at the
    peak), and the buffers (`estimate/buffers.py`); `chunk_pieces`: each plan's
    `chunk_activation_pieces`."""
    layers = tuple(i for plan in plans for i in plan.layers)
    labels = positions(layers, any(p.first for p in plans), any(p.last for p in plans))
    pieces = [p for ps in reversed(chunk_pieces) for p in ps]
    return Walk(
        labels,
        held,
        tuple(p[0] for p in pieces),
        tuple(p[2] for p in pieces),
        frozen=frozen_units(cfg, base, labels),
        receive=receive_buffers(cfg, plans, schedule, r, prec),
        pipeline_zero=pipeline_buffers(cfg, states, prec, plans, schedule, r, base),
        dequantized=_dequantized(cfg, params),
        **zero_units(cfg, params, labels, states.groups, prec),
    )


def _dequantized(cfg: Config, params: list) -> int:
    """An NF4 base's weight dequantized as a block's backward starts, beyond the activations
    then: the down projection's, less its input that the adapter's nodes free just before
    (without full recomputation)."""
    dequantized = dequantized_bytes(params, cfg)
    if not dequantized or cfg.memory.recompute == "full":
        return dequantized
    return max(dequantized - down_input_bytes(cfg.model, _shape(cfg)), 0)


def _two_bw_states(states: States) -> int:
    """PipeDream-2BW keeps a second fp32 weight version, moments as DP; its gradients are no
    fixed state (one or two sets alive, `estimate/two_bw.py`): taken out, their bytes
    (one set) returned."""
    params = states.bytes.get("parameters", {}).get("device", 0)
    states.add("parameters", "device", params)
    return states.bytes.pop("gradients", {}).get("device", 0)


def _state_lines(states: States, cfg: Config, prec: ElementBytes) -> list[Line]:
    par = cfg.parallel
    n, stage = par.dp, cfg.memory.zero
    full = sum(padded for _, padded in states.groups)
    shard = full if stage == 0 else full // n
    why = {
        "parameters": f"{shard if stage == 3 else full:,} el x {prec.param} B"
        + (" (ZeRO-3: 1/N)" if stage == 3 else ""),
        "gradients": f"{full if stage <= 1 else shard:,} el x {prec.reduce} B"
        + (" (ZeRO-2/3: 1/N)" if stage >= 2 else "")
        + (": 2BW, 1-2 sets alive, counted in the total's moments" if par.two_bw else ""),
        "master_weights": f"{shard:,} el x {FP32} B fp32 copy"
        + (
            ""
            if prec.param != FP32 or cfg.memory.offload != "none"
            else ": none, fp32 params are it"
        ),
        "optimizer_states": f"{ADAM_STATES} x {shard:,} el x {FP32} B (Adam moments"
        + (", 1/N)" if stage >= 1 else ")"),
    }
    lines = []
    who = "adapters: " if cfg.model.lora is not None else ""  # only they train
    for name in LESSON_ORDER[:4]:
        per = states.bytes.get(name, {})
        places = {p: per.get(p, 0) for p in PLACES}
        lines.append(Line(name, **places, formula=who + why[name]))
    return lines


def _activation_line(
    cfg: Config, plans: list[StagePlan], held: int, host: int, in_flight: int
) -> Line:
    x, mode = _shape(cfg), cfg.memory.recompute
    layer = _layer_bytes(cfg, x)
    layers = sum(len(p.layers) for p in plans)
    what = f"{layers} layers x {layer:,} B/layer (recompute {mode}) + ends"
    if len(plans) > 1 or in_flight > 1:
        what += f"; {in_flight} micro-batch chunks in flight (schedule {cfg.parallel.schedule})"
    if host:
        what += "; the blocks' on the host (--offload-activations cpu), the ends' on the device"
    if cfg.memory.partition_activations:  # estimate/partitioned.py
        what += f"; less (1 - 1/{x.t}) of each block input (--partition-activations)"
    if x.cp > 1:  # context parallelism (estimate/activations.py: context_bytes)
        what += f"; cp {x.cp} ({x.exchange}): {x.s:,} tokens a row per rank"
    if act.mask_bytes(cfg.model, x, mode):  # instruction data (estimate/activations.py)
        what += f"; packed rows: one {act.mask_bytes(cfg.model, x, mode):,} B mask per chunk"
    elif x.packed and x.attention != "mask":
        what += f"; packed rows attended {x.attention}: no mask"
    return Line("activations", held, host=host, formula=what)


def _reference(cfg: Config, facts: ModelFacts) -> dict[str, float]:
    """Single-GPU and ZeRO closed forms for this model at this dp (no tp, no pp); under
    LoRA Ψ is the base's, Φ the adapters', and one GPU holds base·Ψ + (p+g+k)Φ."""
    m, par = cfg.model, cfg.parallel
    prec = ElementBytes.of_run(cfg)
    psi = facts.total_parameters(None if m.lora is None else False)
    optim = ADAM_STATES * FP32 + (FP32 if prec.param != FP32 else 0)
    zero = {
        f"zero{s}_per_rank": zero_model_state_bytes(s, psi, par.dp, prec.param, prec.reduce, optim)
        for s in range(4)
    }
    out = {
        "psi": psi,
        "mixed_precision_adam_16psi": mixed_precision_adam_bytes(psi),
        "bf16_finetune_12psi": sixteen_bit_finetune_bytes(psi),
        **zero,
    }
    if m.lora is not None:
        phi = facts.total_parameters(True)
        per = prec.param + prec.reduce + optim
        out |= {
            "lora_phi": phi,
            "lora_bytes_per_adapter_param": per,
            "lora_one_gpu": base_total_bytes(cfg, prec, psi) + per * phi,
        }
    return out
