"""Tests for plait.config: building, TOML loading and validation (pure, no processes)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from plait.cli.run_flags import load_toml
from plait.config import (
    SECTIONS,
    Config,
    DataConfig,
    LoRAConfig,
    MemoryConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    build_config,
    validate_config,
)
from plait.errors import ConfigError
from plait.models.presets import get_preset
from plait.preflight import check_run


def tiny(**sections: dict[str, Any]) -> Config:
    """tiny-gpt with a seq_len its learned positions allow, plus per-section overrides."""
    overrides: dict[str, dict[str, Any]] = {"train": {"seq_len": 32}}
    for section, values in sections.items():
        overrides.setdefault(section, {}).update(values)
    return build_config("tiny-gpt", overrides)


def expect_error(cfg: Config, message: str, check_data: bool = False) -> str:
    with pytest.raises(ConfigError) as e:
        check_run(cfg, check_data=check_data)
    assert message in str(e.value), f"{message!r} not in {str(e.value)!r}"
    return str(e.value)


# --- build_config -------------------------------------------------------------------------


def test_build_config_takes_the_preset_model_and_dataclass_defaults() -> None:
    cfg = build_config("tiny-gpt", {})
    assert cfg.preset == "tiny-gpt"
    assert cfg.model == get_preset("tiny-gpt")
    assert cfg.train == TrainConfig()
    assert cfg.parallel == ParallelConfig()
    assert cfg.data == DataConfig()
    assert (cfg.optim, cfg.memory, cfg.lora) == (OptimConfig(), MemoryConfig(), LoRAConfig())


def test_overrides_beat_preset_and_defaults() -> None:
    cfg = build_config(
        "tiny-gpt",
        {
            "model": {"n_layers": 3},
            "train": {"steps": 7},
            "optim": {"lr": 1e-3},
            "parallel": {"dp": 2},
        },
    )
    assert cfg.model.n_layers == 3  # override beats preset (2)
    assert cfg.model.d_model == 64  # untouched preset value
    assert cfg.model.vocab_size == 256
    assert cfg.train.steps == 7 and cfg.optim.lr == 1e-3
    assert cfg.train.micro_batch == TrainConfig().micro_batch  # untouched default
    assert cfg.parallel.dp == 2 and cfg.parallel.layout.dp == 2
    # The preset table itself is not modified by an override.
    assert get_preset("tiny-gpt").n_layers == 2


def test_configs_do_not_share_mutable_sections() -> None:
    a = build_config("tiny-gpt", {"train": {"steps": 11}})
    b = build_config("tiny-gpt", {})
    assert a.train.steps == 11 and b.train.steps == TrainConfig().steps
    assert a.train is not b.train and a.model is not b.model


def test_unknown_section_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as e:
        build_config("tiny-gpt", {"optimizer": {"lr": 1.0}})
    assert str(e.value) == (
        "unknown config section [optimizer]; known: model, lora, parallel, memory, train, "
        "optim, data, checkpoint, log"
    )


def test_unknown_key_names_it_and_its_section() -> None:
    with pytest.raises(ConfigError) as e:
        build_config("tiny-gpt", {"train": {"stepz": 3}})
    msg = str(e.value)
    assert msg.startswith("unknown key 'stepz' in [train]; known: ")
    known = msg.split("known: ", 1)[1].split(", ")
    assert "steps" in known and "micro_batch" in known and known == sorted(known)


def test_unknown_preset_lists_known_presets() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown model preset 'nope'; known presets: .*tiny-gpt"
    ):
        build_config("nope", {})


def test_sections_and_accumulation() -> None:
    assert list(SECTIONS) == [
        "model", "lora", "parallel", "memory", "train", "optim", "data", "checkpoint", "log"
    ]  # fmt: skip
    cfg = tiny(train={"global_batch": 24, "micro_batch": 4}, parallel={"dp": 3})
    validate_config(cfg)
    assert cfg.accumulation == 2
    d = cfg.to_dict()
    assert d["train"]["global_batch"] == 24 and d["model"]["d_model"] == 64


# --- validate_config without data ---------------------------------------------------------


def test_a_sensible_config_validates() -> None:
    validate_config(tiny())
    tiny().validate()


def test_global_batch_not_a_multiple_names_all_three_numbers() -> None:
    cfg = tiny(train={"global_batch": 10, "micro_batch": 4}, parallel={"dp": 2})
    msg = expect_error(cfg, "global batch 10 is not a multiple of micro-batch 4 x dp 2 = 8")
    assert "accumulation" in msg


def test_global_batch_divisible_by_micro_batch_but_not_by_dp() -> None:
    cfg = tiny(train={"global_batch": 12, "micro_batch": 4}, parallel={"dp": 2})
    expect_error(cfg, "global batch 12 is not a multiple of micro-batch 4 x dp 2 = 8")


def test_global_batch_smaller_than_one_micro_batch_per_replica() -> None:
    expect_error(tiny(train={"global_batch": 4, "micro_batch": 8}), "micro-batch 8 x dp 1 = 8")


def test_seq_len_beyond_learned_positions() -> None:
    cfg = build_config("tiny-gpt", {"train": {"seq_len": 65}})
    expect_error(cfg, "seq_len 65 exceeds the model's max_seq_len 64")
    # Exactly max_seq_len is fine, and RoPE models have no learned-position limit.
    validate_config(build_config("tiny-gpt", {"train": {"seq_len": 64}}))
    validate_config(build_config("tiny-llama", {"train": {"seq_len": 128}}))


def test_bad_recompute_mode() -> None:
    expect_error(
        tiny(memory={"recompute": "partial"}),
        "recompute must be one of none, full, selective; got 'partial'",
    )
    for mode in ("none", "full", "selective"):
        validate_config(tiny(memory={"recompute": mode}))


@pytest.mark.parametrize(
    ("lr", "min_lr", "message"),
    [
        (0.0, 0.0, "optim.lr must be > 0, got 0.0"),
        (-1e-3, 0.0, "optim.lr must be > 0, got -0.001"),
        (1e-3, -1e-4, "optim.min_lr must be >= 0, got -0.0001"),
        (1e-3, 2e-3, "need min_lr <= lr; got lr=0.001, min_lr=0.002"),
    ],
)
def test_lr_and_min_lr(lr: float, min_lr: float, message: str) -> None:
    expect_error(tiny(optim={"lr": lr, "min_lr": min_lr}), message)


def test_min_lr_equal_to_lr_and_zero_are_fine() -> None:
    validate_config(tiny(optim={"lr": 1e-3, "min_lr": 1e-3}))
    validate_config(tiny(optim={"lr": 1e-3, "min_lr": 0.0}))


def test_negative_warmup_grad_clip_eval_every() -> None:
    expect_error(tiny(optim={"warmup_steps": -1}), "optim.warmup_steps must be >= 0, got -1")
    expect_error(tiny(optim={"grad_clip": -0.5}), "optim.grad_clip must be >= 0, got -0.5")
    expect_error(tiny(train={"eval_every": -2}), "train.eval_every must be >= 0, got -2")
    validate_config(tiny(optim={"warmup_steps": 0, "grad_clip": 0.0}))


def test_bucket_and_timeout_must_be_positive() -> None:
    expect_error(tiny(parallel={"bucket_mb": 0.0}), "parallel.bucket_mb must be > 0, got 0.0")
    expect_error(
        tiny(parallel={"comm_timeout": -1.0}), "parallel.comm_timeout must be > 0, got -1.0"
    )


def test_device(monkeypatch) -> None:
    expect_error(tiny(train={"device": "tpu"}), "device must be one of auto, cpu, cuda; got 'tpu'")
    monkeypatch.setattr("plait.config.checks.cuda_available", lambda: True)
    for device in ("auto", "cpu", "cuda"):
        validate_config(tiny(train={"device": device}))
    monkeypatch.setattr("plait.config.checks.cuda_available", lambda: False)  # asked for, not there
    expect_error(tiny(train={"device": "cuda"}), "device 'cuda' was asked for, but this torch")
    validate_config(tiny(train={"device": "auto"}))  # auto falls back


def test_vocab_smaller_than_bytes() -> None:
    expect_error(
        tiny(model={"vocab_size": 255}),
        "model.vocab_size 255 is smaller than the byte tokenizer's 256",
    )
    validate_config(tiny(model={"vocab_size": 300}))


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_val_fraction(fraction: float) -> None:
    expect_error(
        tiny(data={"val_fraction": fraction}),
        f"data.val_fraction must be in (0, 1), got {fraction}",
    )


@pytest.mark.parametrize(
    "name", ["steps", "micro_batch", "global_batch", "seq_len", "eval_batches"]
)
@pytest.mark.parametrize("value", [0, -3])
def test_train_counts_must_be_positive(name: str, value: int) -> None:
    expect_error(tiny(train={name: value}), f"train.{name} must be >= 1, got {value}")


@pytest.mark.parametrize("dp", [0, -1])
def test_dp_must_be_positive(dp: int) -> None:
    expect_error(tiny(parallel={"dp": dp}), f"parallel.dp must be >= 1, got {dp}")


def test_model_validate_runs_first_indivisible_heads() -> None:
    expect_error(tiny(model={"n_heads": 3}), "model.d_model=64 is not divisible by model.n_heads=3")
    expect_error(
        tiny(model={"n_kv_heads": 3}), "model.n_heads=4 is not divisible by model.n_kv_heads=3"
    )
    expect_error(tiny(model={"n_layers": 0}), "model.n_layers must be >= 1, got 0")
    # Model problems are reported even when the training section is also wrong.
    expect_error(
        tiny(model={"n_heads": 3}, train={"steps": 0}),
        "model.d_model=64 is not divisible by model.n_heads=3",
    )


def test_negative_kv_heads_is_rejected() -> None:
    with pytest.raises(ConfigError, match="n_kv_heads"):
        validate_config(tiny(model={"n_kv_heads": -1}))


def test_wrongly_typed_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="steps"):
        validate_config(tiny(train={"steps": "5"}))


# --- validate_config with data checks -----------------------------------------------------


def write_corpus(tmp_path: Path, nbytes: int) -> Path:
    path = tmp_path / "corpus.txt"
    text = ("the quick brown fox jumps over the lazy dog\n" * (nbytes // 44 + 1))[:nbytes]
    path.write_text(text)
    assert path.stat().st_size == nbytes
    return path


def test_missing_data_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such.txt"
    msg = expect_error(tiny(data={"path": str(missing)}), str(missing), check_data=True)
    assert "does not exist" in msg
    # Without data checks the path is not looked at.
    validate_config(tiny(data={"path": str(missing)}))


def test_corpus_large_enough_validates(tmp_path: Path) -> None:
    path = write_corpus(tmp_path, 4000)
    check_run(tiny(data={"path": str(path)}, train={"global_batch": 8, "micro_batch": 4}))


def test_corpus_too_short_for_global_batch(tmp_path: Path) -> None:
    # 2000 bytes at seq_len 32: 60 blocks of one window (33 tokens), 3 of them held out.
    path = write_corpus(tmp_path, 2000)
    cfg = tiny(data={"path": str(path)}, train={"global_batch": 64, "micro_batch": 8})
    msg = expect_error(cfg, f"corpus {str(path)!r} has 2000 bytes", check_data=True)
    assert "57 training and 3 validation sequences of seq_len 32" in msg
    assert "needs 64 training sequences" in msg


def test_corpus_too_short_for_validation(tmp_path: Path) -> None:
    # 40 bytes: one window of seq_len 32 (needs 33 tokens), one block, nothing to hold out.
    path = write_corpus(tmp_path, 40)
    cfg = tiny(data={"path": str(path)}, train={"global_batch": 1, "micro_batch": 1})
    msg = expect_error(cfg, "has 40 bytes", check_data=True)
    assert "1 training and 0 validation sequences of seq_len 32" in msg
    assert "validation at least 1" in msg


def test_max_bytes_caps_the_corpus(tmp_path: Path) -> None:
    path = write_corpus(tmp_path, 4000)
    batch = {"global_batch": 40, "micro_batch": 8}
    check_run(tiny(data={"path": str(path)}, train=batch))
    cfg = tiny(data={"path": str(path), "max_bytes": 1000}, train=batch)
    expect_error(cfg, "has 1000 bytes: 29 training", check_data=True)


@pytest.mark.parametrize(
    ("nbytes", "seq_len", "fraction"), [(21, 2, 0.2), (700, 8, 0.05), (30_011, 4, 0.3)]
)
def test_corpus_check_agrees_with_the_real_split(
    tmp_path: Path, nbytes: int, seq_len: int, fraction: float
) -> None:
    """The check counts the windows `load_corpus` makes: a global batch of exactly the
    training windows passes, one more is refused naming both sides' counts."""
    from plait.build.corpus import load_corpus

    path = write_corpus(tmp_path, nbytes)
    data = {"path": str(path), "val_fraction": fraction}
    seq = {"seq_len": seq_len, "micro_batch": 1}
    corpus = load_corpus(tiny(data=data, train=seq))
    train, val = len(corpus.train), len(corpus.val)
    assert train > 0 and val > 0
    check_run(tiny(data=data, train={**seq, "global_batch": train}))
    cfg = tiny(data=data, train={**seq, "global_batch": train + 1})
    msg = expect_error(cfg, f"has {nbytes} bytes", check_data=True)
    assert f"{train} training and {val} validation sequences of seq_len {seq_len}" in msg


# --- load_toml ----------------------------------------------------------------------------


def test_load_toml_valid(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "tiny-gpt"\nn_layers = 3\n\n[optim]\nlr = 1e-3\n')
    assert load_toml(path) == {
        "model": {"preset": "tiny-gpt", "n_layers": 3},
        "optim": {"lr": 1e-3},
    }
    assert load_toml(str(path)) == load_toml(path)


def test_load_toml_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as e:
        load_toml(missing)
    assert str(e.value) == f"config file {str(missing)!r} does not exist"
    with pytest.raises(ConfigError, match="is a folder; give a TOML file"):
        load_toml(tmp_path)  # a folder is not a config file
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe\x00model")
    with pytest.raises(ConfigError, match="is not text"):
        load_toml(tmp_path / "binary.toml")


def test_load_toml_invalid(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[train\nsteps = \n")
    with pytest.raises(
        ConfigError, match=re.escape(f"config file {str(path)!r} is not valid TOML")
    ):
        load_toml(path)


def test_load_toml_top_level_key_must_be_a_section(tmp_path: Path) -> None:
    path = tmp_path / "flat.toml"
    path.write_text("steps = 3\n\n[train]\nlr = 1e-3\n")
    with pytest.raises(ConfigError) as e:
        load_toml(path)
    assert str(e.value) == f"config file {str(path)!r}: top-level key 'steps' must be a [section]"


def test_checkpoint_options() -> None:
    expect_error(tiny(checkpoint={"save_every": -1}), "checkpoint.save_every must be >= 0, got -1")
    expect_error(tiny(train={"max_restarts": -2}), "train.max_restarts must be >= 0, got -2")
    expect_error(
        tiny(checkpoint={"keep_checkpoints": 0}), "checkpoint.keep_checkpoints must be >= 1, got 0"
    )
