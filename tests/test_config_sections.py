"""The configuration by concern: the sections, the keys that moved between them (refused in
one line naming the new place), the field types read with `typing` (one rule for the TOML
check and the flags), and the choices a `Literal` declares (pure, no processes)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, get_args

import pytest

from plait.cli import build_parser, main
from plait.cli.run_flags import config_from_args
from plait.config import MOVED, SECTIONS, DataConfig, TrainConfig, build_config, flag_name
from plait.config.types import check_types, choices, field_kind, field_types, type_ok
from plait.data.batches import LOSS_AVERAGES
from plait.data.packing import LONG
from plait.errors import ConfigError


def test_every_moved_key_has_left_its_old_section_for_a_field_of_the_new() -> None:
    for (old, key), (new, name) in MOVED.items():
        fields = {f.name for f in dataclasses.fields(SECTIONS[new])}
        assert name in fields, (old, key, new, name)
        if old != "model":  # the model keeps its own record of its adapters (lora_rank ...)
            assert key not in {f.name for f in dataclasses.fields(SECTIONS[old])}


@pytest.mark.parametrize(
    ("section", "key", "new"),
    [("train", "lr", "[optim] lr"), ("model", "lora_rank", "[lora] rank"),
     ("parallel", "zero", "[memory] zero"), ("parallel", "base_dtype", "[lora] base_dtype"),
     ("train", "init_from", "[checkpoint] init_from"), ("train", "out", "[log] out")],
)  # fmt: skip
def test_a_moved_key_is_refused_naming_its_new_place(section: str, key: str, new: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_config("tiny-gpt", {section: {key: 1}})
    assert str(e.value).startswith(f"[{section}] {key} has moved: write it as {new} ")


def test_a_config_file_with_an_old_key_exits_2_in_one_line(tmp_path: Path, capsys) -> None:
    old = tmp_path / "old.toml"
    old.write_text(
        '[model]\npreset = "tiny-gpt"\n\n[train]\nseq_len = 32\nlr = 1e-3\n'
    )  # cfg-renames: keep
    assert main(["estimate", "--config", str(old)]) == 2
    err = capsys.readouterr().err
    moved = "[train] lr has moved: write it as [optim] lr"  # cfg-renames: keep
    assert err.count("\n") == 1 and moved in err
    lora = tmp_path / "lora.toml"
    lora.write_text('[model]\npreset = "tiny-llama"\nlora_rank = 4\n')  # cfg-renames: keep
    with pytest.raises(
        ConfigError, match=r"\[model\] lora_rank has moved: write it as \[lora\] rank"
    ):
        config_from_args(build_parser().parse_args(["estimate", "--config", str(lora)]))


def test_every_flag_keeps_its_name() -> None:
    """The flags of the sections, as they were before the split (the [lora] fields keep
    their --lora- names; the model's record of them has no flag of its own)."""
    flags = {flag_name(f) for cls in SECTIONS.values() for f in dataclasses.fields(cls)
             if not f.metadata.get("derived")}  # fmt: skip
    for name in ("--lora-rank", "--lora-alpha", "--lora-dropout", "--lora-targets", "--lr",
                 "--zero", "--base-dtype", "--adapter", "--init-from", "--out", "--data",
                 "--precision", "--recompute", "--keep-best", "--warmup-ratio"):  # fmt: skip
        assert name in flags
    args = build_parser().parse_args(
        ["estimate", "--model", "tiny-llama", "--seq-len", "32", "--lora-rank", "4", "--lr",
         "1e-3", "--zero", "2", "--base-dtype", "bf16", "--out", "runs/x"]
    )  # fmt: skip
    cfg = config_from_args(args, check_data=False)
    assert (cfg.lora.rank, cfg.model.lora_rank, cfg.optim.lr) == (4, 4, 1e-3)
    assert (cfg.memory.zero, cfg.lora.base_dtype, cfg.log.out) == (2, "bf16", "runs/x")


def test_field_kinds_come_from_the_annotations() -> None:
    assert field_kind(int | None) is int and field_kind(Literal["a", "b"]) is str
    assert field_kind(bool) is bool and field_kind(float) is float
    with pytest.raises(TypeError):
        field_kind(list[int])  # a section holds scalars only
    assert type_ok(float, 3) and not type_ok(int, 3.0) and not type_ok(int, True)
    assert type_ok(str | None, None) and not type_ok(str, None)
    assert not type_ok(bool, 1) and type_ok(Literal["a"], "b")  # choices: `check_types`
    for cls in SECTIONS.values():  # every field of every section has one kind
        assert all(field_kind(tp) in (bool, int, float, str) for tp in field_types(cls).values())


def test_type_and_choice_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^train.steps must be int, got '5' \(str\)$"):
        check_types("train", TrainConfig(steps="5"))
    with pytest.raises(ConfigError, match=r"^data.tokenizer must be str \| None, got 3 \(int\)$"):
        check_types("data", DataConfig(tokenizer=3))
    with pytest.raises(ConfigError, match=r"^nan_policy must be one of stop, skip; got 'maybe'$"):
        check_types("train", TrainConfig(nan_policy="maybe"))


def test_the_choices_are_the_ones_the_data_package_runs() -> None:
    hints = field_types(DataConfig)
    assert choices(hints["long"]) == LONG
    assert choices(field_types(TrainConfig)["loss_average"]) == LOSS_AVERAGES
    assert get_args(hints["pack"]) == ()  # a plain bool: no choices
