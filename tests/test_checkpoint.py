"""Checkpoints: exact resume in the same layout, resume in another layout, atomic commit.

A run of 6 steps is the reference. The same run saved at step 3 and resumed (same layout)
must give bitwise the same losses and parameters; resumed under another layout, ZeRO stage,
precision policy or offload it must follow the reference within rtol 1e-5 (fp32), because
every layout reproduces the single process and the checkpoint names tensors by their
single-process names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.checkpoint import store
from plait.checkpoint.boxes import Box, range_boxes, to_global
from plait.errors import ConfigError
from plait.mesh import build_mesh
from plait.parallel.tp.sharding import full_tensor, param_shard_specs, split_spec
from plait.train import Trainer
from reference import corpus_for, small_config
from sections import set_option

STEPS, AT = 6, 3
RTOL = 1e-5
PARAM_ATOL = 1e-5  # Adam turns rounding-level gradient differences into ~1e-6 (see dp parity)


# ---------------------------------------------------------------- pure: boxes and store
def test_flat_ranges_become_contiguous_boxes() -> None:
    for shape in [(7,), (4, 3), (3, 4, 5), (1, 6)]:
        full = torch.arange(torch.Size(shape).numel()).view(shape)
        for start in range(full.numel()):
            for length in range(full.numel() - start + 1):
                flat = full.reshape(-1)[start : start + length]
                boxes = range_boxes(shape, start, length)
                assert sum(b.numel for b in boxes) == length
                for b in boxes:
                    index = tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes, strict=True))
                    assert torch.equal(full[index].reshape(-1), flat[b.start : b.start + b.numel])


def test_tp_shard_boxes_drop_the_vocabulary_padding() -> None:
    spec = split_spec((10, 4), 0, rank=2, size=3, pad=True)  # rows 8..9 real, 2 rows padding
    assert to_global(Box((0, 0), (4, 4)), spec) == Box((8, 0), (2, 4))
    assert to_global(Box((3, 1), (1, 3), 5), spec) is None  # all padding
    assert to_global(Box((1, 2), (1, 2), 7), spec) == Box((9, 2), (1, 2), 7)


def _fake_checkpoint(root: Path, step: int, commit: bool) -> Path:
    path = store.step_dir(root, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"tensors" * step)
    if commit:
        store.write_manifest(path, {"step": step, "config": {}})
    return path


def test_latest_skips_an_unfinished_save_and_prune_keeps_the_newest(tmp_path: Path, capsys):
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path, step, commit=True)
    _fake_checkpoint(tmp_path, 8, commit=False)  # killed during the save
    assert store.latest(tmp_path) == store.step_dir(tmp_path, 6)
    assert "step-8: the save did not finish (no COMMITTED)" in capsys.readouterr().err
    store.prune(tmp_path, keep=2)
    assert store.latest(tmp_path) == store.step_dir(tmp_path, 6)
    assert not store.step_dir(tmp_path, 2).exists() and store.step_dir(tmp_path, 4).exists()
    with pytest.raises(ConfigError, match="the save did not finish"):
        store.resolve(str(store.step_dir(tmp_path, 8)), tmp_path)
    assert store.resolve("latest", tmp_path / "elsewhere") is None  # a first start: step 0


def test_prune_spares_the_best_checkpoint(tmp_path: Path) -> None:
    """--keep-best: the checkpoint best.json names outlives pruning though it is not among the
    newest (the launched run in test_run_features.py cannot count on its data's best being
    an early step)."""
    for step in (2, 4, 6, 8):
        _fake_checkpoint(tmp_path, step, commit=True)
    store.mark_best(tmp_path, 4, 1.5, keep=1)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert kept == ["step-4", "step-8"]
    assert store.read_best(tmp_path)["step"] == 4
    store.mark_best(tmp_path, 8, 1.25, keep=1)  # a newer best: the old one goes
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-8"]


def test_a_run_folder_names_its_newest_committed_checkpoint(tmp_path: Path, capsys) -> None:
    """Every command that takes a checkpoint takes its run folder too (`store.complete`), and
    a folder that is neither is named for what it is."""
    run = tmp_path / "run"
    for step in (2, 4):
        _fake_checkpoint(run, step, commit=True)
    _fake_checkpoint(run, 6, commit=False)
    assert store.complete(run) == store.resolve(str(run), tmp_path) == store.step_dir(run, 4)
    assert "step-6: the save did not finish (no COMMITTED)" in capsys.readouterr().err
    assert store.complete(store.step_dir(run, 2)) == store.step_dir(run, 2)
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    cases = [
        (empty, f"the run {str(empty)!r} has no checkpoint (trained with --no-save"),
        (store.step_dir(run, 6), "step-6': the save did not finish (no COMMITTED)"),
        (tmp_path, "is neither a checkpoint (OUT/checkpoints/step-N, with COMMITTED) nor a run"),
        (run / "checkpoints" / "step-2" / "COMMITTED", "is a file; give a checkpoint folder"),
        (tmp_path / "missing", "does not exist"),
    ]
    for path, message in cases:
        with pytest.raises(ConfigError) as e:
            store.complete(path)
        assert message in str(e.value), path


def test_damaged_and_mismatched_checkpoints_are_named(tmp_path: Path) -> None:
    path = _fake_checkpoint(tmp_path, 3, commit=True)
    config = small_config().to_dict()
    state = json.loads((path / store.TRAINER).read_text())
    (path / store.TRAINER).write_text(json.dumps({**state, "config": config}))
    store.write_manifest(path, {**state, "config": config})
    other = json.loads(json.dumps(config))
    other["model"]["d_model"] = 2 * config["model"]["d_model"]
    with pytest.raises(ConfigError) as e:
        store.check_resumable(path, other)
    d, saved = config["model"]["d_model"], store.describe_model(config)
    assert f"holds another model: {saved}; this run asks for" in str(e.value)
    assert f"d_model {d}, " in saved and f"d_model {2 * d}, " in store.describe_model(other)
    other = json.loads(json.dumps(config))  # a gpt checkpoint resumed as a llama: both named
    other["preset"] = "tiny-llama"
    other["model"].update(norm="rmsnorm", mlp="swiglu", pos="rope", n_kv_heads=2)
    with pytest.raises(ConfigError) as e:
        store.check_resumable(path, other)
    assert "holds another model: tiny-gpt (" in str(e.value) and "n_kv_heads=" not in str(e.value)
    assert "asks for tiny-llama (" in str(e.value)
    assert "2 kv heads, rmsnorm, swiglu, rope positions)" in str(e.value)
    other = json.loads(json.dumps(config))  # the default kv head count is the head count
    other["model"]["n_kv_heads"] = config["model"]["n_heads"]
    other["model"]["ffn_hidden"] = 3  # not an architecture field: named alone
    with pytest.raises(ConfigError, match=r"saved with model\.ffn_hidden=.*; this run asks for 3"):
        store.check_resumable(path, other)
    other = json.loads(json.dumps(config))
    other["train"]["global_batch"] += 2
    with pytest.raises(ConfigError, match=r"saved with train\.global_batch"):
        store.check_resumable(path, other)
    (path / "__0_0.distcp").write_bytes(b"tampered")
    with pytest.raises(ConfigError, match=r"is damaged: __0_0\.distcp is missing or cut"):
        store.check_resumable(path, config)


# ---------------------------------------------------------------- multi-rank: resume
def _config(layout: dict):
    kw = dict(layout)
    parallel = kw.pop("par", {})
    cfg = small_config(steps=STEPS, **kw)
    for key, value in parallel.items():
        set_option(cfg, "parallel", key, value)
    cfg.validate()
    return cfg


def _gathered(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds, whole (tp shards gathered, ZeRO-3 gathered), fp32."""
    specs = param_shard_specs(trainer.model)
    with trainer.engine.unsharded():
        return {
            n: (full_tensor(p, specs[n], trainer.comm) if n in specs else p.detach())
            .float()
            .clone()
            for n, p in trainer.model.named_parameters()
        }


def _phase(
    layout: dict,
    steps: int,
    save_to: str | None = None,
    load: str | None = None,
    save_after: int | None = None,
):
    """Train `steps` steps (after loading `load`), saving to `save_to` after `save_after` of
    them (default: at the end) as a run's --save-every does; losses and parameters."""
    cfg = _config(layout)
    corpus = corpus_for(cfg)
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), 60)
    trainer = Trainer(cfg, mesh, corpus)
    if load:
        trainer.load(Path(load))
    save_after = steps if save_after is None else save_after
    losses = []
    for done in range(1, steps + 1):
        losses.append(trainer.train_step().loss)
        if save_to and done == save_after:
            trainer.save(Path(save_to))
    params = _gathered(trainer)
    trainer.close()
    return {"losses": losses, "params": params}


def _reference(world, layout: dict, tmp: Path) -> tuple[dict, list[float], str]:
    """The uninterrupted run, its losses up to step AT, and the checkpoint it saved there:
    one run that saves on the way, as a run with --save-every does (a run of its own for the
    checkpoint cost a third more steps and a trainer's start per case)."""
    full = world.run(_phase, layout, STEPS, save_to=str(tmp), save_after=AT)[0]
    return full, full["losses"][:AT], str(store.step_dir(tmp, AT))


def _params_by_name(results: list[dict]) -> dict[str, torch.Tensor]:
    """A pipeline spreads the parameters over ranks: merge what every rank holds."""
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r["params"])
    return merged


SAME_LAYOUT = [
    dict(dp=2),
    dict(dp=2, accum=2, par=dict(zero=3)),
    dict(dp=2, par=dict(zero=1, precision="bf16")),
    dict(dp=2, par=dict(zero=2, precision="fp16")),  # the loss scaler continues
    dict(dp=2, par=dict(zero=2, offload="cpu")),
    dict(dp=2, par=dict(zero=1, offload="nvme", offload_dir="TMP")),  # TMP: the test's folder
    dict(pp=2, accum=2, par=dict(schedule="1f1b")),
    dict(pp=2, accum=2, par=dict(schedule="gpipe")),
    dict(pp=2, accum=2, par=dict(schedule="zb-h1")),  # the split backward's W queue is empty
    dict(pp=2, accum=2, n_layers=4, par=dict(schedule="interleaved", virtual_stages=2)),
    dict(pp=2, accum=3, dropout=0.1, par=dict(schedule="2bw")),  # both weight versions
    dict(tp=2, accum=2, dropout=0.1, recompute="full", par=dict(sequence_parallel=True)),
]


@pytest.mark.parametrize("layout", SAME_LAYOUT, ids=lambda c: json.dumps(c))
def test_resume_in_the_same_layout_is_bitwise(world2, layout, tmp_path: Path) -> None:
    if layout.get("par", {}).get("offload_dir") == "TMP":
        layout = {**layout, "par": {**layout["par"], "offload_dir": str(tmp_path / "nvme")}}
    full, first, ckpt = _reference(world2, layout, tmp_path / "ckpt")
    rest = world2.run(_phase, layout, STEPS - AT, load=ckpt)
    assert first + rest[0]["losses"] == full["losses"]
    for name, value in full["params"].items():
        assert torch.equal(rest[0]["params"][name], value), name


CHANGES_2 = [  # (saved under, resumed under): every pair keeps micro-batch x accumulation x dp
    (dict(dp=2, par=dict(zero=3)), dict(tp=2, accum=2, par=dict(sequence_parallel=True))),
    (dict(pp=2, accum=2, n_layers=4), dict(pp=2, accum=2, n_layers=4, par=dict(
        schedule="interleaved", virtual_stages=2))),
    (dict(tp=2, accum=2), dict(dp=2, par=dict(zero=2, offload="cpu"))),
    # whole-parameter AdamW state (naive dp's coordinator) and ZeRO shards, both ways
    (dict(dp=2, par=dict(dp_mode="naive")), dict(dp=2, par=dict(zero=2))),
    (dict(dp=2, par=dict(zero=1)), dict(dp=2, par=dict(dp_mode="naive"))),
]  # fmt: skip


@pytest.mark.parametrize(("saved", "resumed"), CHANGES_2, ids=lambda c: json.dumps(c))
def test_resume_in_another_layout_follows_the_run(world2, saved, resumed, tmp_path: Path) -> None:
    full, _, ckpt = _reference(world2, saved, tmp_path)
    rest = world2.run(_phase, resumed, STEPS - AT, load=ckpt)
    torch.testing.assert_close(
        torch.tensor(rest[0]["losses"]), torch.tensor(full["losses"][AT:]), rtol=RTOL, atol=0
    )
    got, want = _params_by_name(rest), _params_by_name([full])
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=PARAM_ATOL, msg=name)


def test_four_ranks_to_a_single_process_and_back(world4, tmp_path: Path) -> None:
    """dp2 x tp2 saved, resumed as pp2 x dp2; 2BW pp2 x tp2 saved, resumed as 2BW pp2 x dp2;
    dp4 ZeRO-1 saved, resumed in this process."""
    grid, pipe = dict(dp=2, tp=2), dict(pp=2, dp=2, micro=1, accum=2)
    full, _, ckpt = _reference(world4, grid, tmp_path / "grid")
    rest = world4.run(_phase, pipe, STEPS - AT, load=ckpt)
    torch.testing.assert_close(
        torch.tensor(rest[0]["losses"]), torch.tensor(full["losses"][AT:]), rtol=RTOL, atol=0
    )
    streamed = dict(pp=2, tp=2, accum=2, par=dict(schedule="2bw"))  # W(k) and W(k-1) move
    wide = dict(pp=2, dp=2, micro=1, accum=2, par=dict(schedule="2bw"))
    full, _, ckpt = _reference(world4, streamed, tmp_path / "2bw")
    rest = world4.run(_phase, wide, STEPS - AT, load=ckpt)
    torch.testing.assert_close(
        torch.tensor(rest[0]["losses"]), torch.tensor(full["losses"][AT:]), rtol=RTOL, atol=0
    )
    sharded = dict(dp=4, par=dict(zero=1))
    full, _, ckpt = _reference(world4, sharded, tmp_path / "dp4")
    single = _phase(dict(accum=4), STEPS - AT, load=ckpt)  # here, no process group
    torch.testing.assert_close(
        torch.tensor(single["losses"]), torch.tensor(full["losses"][AT:]), rtol=RTOL, atol=0
    )
    for name, value in full["params"].items():
        torch.testing.assert_close(single["params"][name], value, rtol=RTOL, atol=PARAM_ATOL)


def test_info_and_consolidate_read_any_layout(world2, tmp_path: Path) -> None:
    """A tp2 checkpoint as one safetensors file: every parameter whole, equal to the run's."""
    from safetensors.torch import load_file

    from plait.checkpoint import inspect

    layout = dict(tp=2, accum=2)
    ran = world2.run(_phase, layout, AT, save_to=str(tmp_path))[0]
    path = store.step_dir(tmp_path, AT)
    facts = inspect.info(path)
    assert (facts["step"], facts["layout"], facts["model"]) == (AT, "dp=1 pp=1 tp=2", "tiny-gpt")
    assert facts["states"] == ["exp_avg", "exp_avg_sq", "master"]
    done = inspect.consolidate(path, tmp_path / "model.safetensors")
    model = load_file(str(tmp_path / "model.safetensors"))
    assert done["parameters"] == facts["parameters"] == sum(t.numel() for t in model.values())
    for name, value in ran["params"].items():
        assert torch.equal(model[name], value), name
    with pytest.raises(ConfigError, match="does not exist"):
        inspect.info(tmp_path / "missing")


def test_single_process_to_dp2_zero3_with_cpu_offload(world2, tmp_path: Path) -> None:
    single, sharded = dict(accum=2), dict(dp=2, par=dict(zero=3, offload="cpu"))
    full = _phase(single, STEPS, save_to=str(tmp_path), save_after=AT)  # here, no group
    rest = world2.run(_phase, sharded, STEPS - AT, load=str(store.step_dir(tmp_path, AT)))
    torch.testing.assert_close(
        torch.tensor(rest[0]["losses"]), torch.tensor(full["losses"][AT:]), rtol=RTOL, atol=0
    )
    for name, value in full["params"].items():
        torch.testing.assert_close(rest[0]["params"][name], value, rtol=RTOL, atol=PARAM_ATOL)


def test_three_axes_to_a_single_process(tmp_path: Path) -> None:
    """dp2 x tp2 x pp2 with ZeRO-1 (8 ranks) saves at step AT; this process resumes it and
    follows the single-process run, which every layout reproduces (the parity tests)."""
    from harness import World

    single, three = dict(accum=4), dict(dp=2, tp=2, pp=2, accum=2, par=dict(zero=1))
    full = _phase(single, STEPS)  # here, no process group
    world8 = World(8)
    try:
        saved = world8.run(_phase, three, AT, save_to=str(tmp_path))[0]
    finally:
        world8.close()
    torch.testing.assert_close(
        torch.tensor(saved["losses"]), torch.tensor(full["losses"][:AT]), rtol=RTOL, atol=0
    )
    rest = _phase(single, STEPS - AT, load=str(store.step_dir(tmp_path, AT)))
    torch.testing.assert_close(
        torch.tensor(rest["losses"]), torch.tensor(full["losses"][AT:]), rtol=RTOL, atol=0
    )
    for name, value in full["params"].items():
        torch.testing.assert_close(rest["params"][name], value, rtol=RTOL, atol=PARAM_ATOL)
