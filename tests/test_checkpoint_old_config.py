"""Checkpoints saved before the configuration was split by concern still read.

Their trainer.json holds the config in the old sections (lr under train, zero under parallel, the
adapters only in [model] ...). Every reader of a saved config goes through
`store.read_trainer`, which moves the old keys to their places now with the one table
`plait.config.MOVED` (`plait.config.saved_config`): a resume, `checkpoint info` and `export
--format peft` of such a checkpoint do what they do for one saved today. A user's TOML with
an old key is still refused (tests/test_config_sections.py).
"""

from __future__ import annotations

import json

import torch

from lora_parity import lora_config
from plait.checkpoint import inspect, store
from plait.cli import main
from plait.config import MOVED, Config, saved_config
from plait.mesh import build_mesh
from plait.train import Trainer
from reference import corpus_for

SPLIT = ("lora", "memory", "optim", "checkpoint", "log")
"""The sections the split made: a config saved before it has none of them."""


def _old_layout(config: dict) -> dict:
    """`config` (a `Config.to_dict()`) as plait saved it before the split: each moved key
    at its old place (the model's `lora_*` were the adapters' only record)."""
    old = json.loads(json.dumps(config))
    for (section, key), (new, name) in MOVED.items():
        value = old[new].pop(name)
        if section != "model":
            old[section][key] = value
    for section in SPLIT:
        assert not old.pop(section), section  # every key of the new sections moved there
    return old


def test_saved_config_moves_each_old_key_to_its_place() -> None:
    old = {  # cfg-renames: keep (the layout before the split)
        "preset": "tiny-llama",
        "model": {"d_model": 64, "lora_rank": 4, "lora_alpha": 8.0, "lora_targets": "all"},
        "parallel": {"dp": 2, "zero": 3, "precision": "bf16", "base_dtype": "nf4"},
        "train": {"steps": 5, "lr": 0.01, "out": "runs/x", "init_from": "hf/base"},
        "data": {"path": "corpus.txt"},
    }
    new = saved_config(old)
    assert new == {
        "preset": "tiny-llama",
        "model": old["model"],  # the model keeps its record of the adapters
        "lora": {"rank": 4, "alpha": 8.0, "targets": "all", "base_dtype": "nf4"},
        "parallel": {"dp": 2},
        "memory": {"zero": 3},
        "train": {"steps": 5, "precision": "bf16"},
        "optim": {"lr": 0.01},
        "checkpoint": {"init_from": "hf/base"},
        "log": {"out": "runs/x"},
        "data": {"path": "corpus.txt"},
    }
    assert old["parallel"] == {"dp": 2, "zero": 3, "precision": "bf16", "base_dtype": "nf4"}
    assert saved_config(new) == new  # today's layout reads as it is


def _lora_run() -> Config:
    cfg = lora_config(steps=4)
    cfg.lora.rank, cfg.lora.targets = cfg.model.lora_rank, cfg.model.lora_targets
    cfg.validate()
    return cfg


def test_a_checkpoint_saved_in_the_old_sections_resumes_and_exports(tmp_path, capsys) -> None:
    cfg = _lora_run()
    mesh = build_mesh(cfg.parallel.layout, torch.device("cpu"), 60)
    trainer = Trainer(cfg, mesh, corpus_for(cfg))
    for _ in range(2):
        trainer.train_step()
    trainer.save(tmp_path / "run")
    uninterrupted = [trainer.train_step().loss for _ in range(2)]  # its steps 3 and 4
    trainer.close()
    path = store.step_dir(tmp_path / "run", 2)
    main(["export", "--checkpoint", str(path), "--format", "peft", "--out", str(tmp_path / "a")])
    today = {k: v for k, v in inspect.info(path).items() if k != "bytes"}

    state = store.read_trainer(path)
    assert state["config"] == cfg.to_dict()
    old = _old_layout(state["config"])
    assert "zero" in old["parallel"] and "lr" in old["train"]  # the layout before the split
    store.write_manifest(path, {**state, "config": old})  # as the old trainer.json was
    assert json.loads((path / store.TRAINER).read_text())["config"] == old

    assert store.read_trainer(path)["config"] == cfg.to_dict()
    assert {k: v for k, v in inspect.info(path).items() if k != "bytes"} == today
    capsys.readouterr()
    assert main(["checkpoint", "info", str(path)]) == 0
    assert "rank 4" in capsys.readouterr().out
    out = tmp_path / "b"
    assert main(["export", "--checkpoint", str(path), "--format", "peft", "--out", str(out)]) == 0
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), name

    assert store.check_resumable(path, cfg.to_dict())["step"] == 2  # what --resume checks
    resumed = Trainer(cfg, mesh, corpus_for(cfg))
    resumed.load(path)
    again = [resumed.train_step().loss for _ in range(2)]
    resumed.close()
    assert again == uninterrupted  # the same layout: bitwise
