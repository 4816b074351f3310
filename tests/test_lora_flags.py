"""Bad LoRA input is one line and exit 2 before any worker starts (issue 22, item 8):
--lora-* without --lora-rank, a rank out of its domain or above a target's width, an unknown
target, GPT-2 with only some of q, k, v; from flags (train and estimate) and from TOML."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.cli import main
from plait.config import build_config
from plait.errors import ConfigError


@pytest.fixture(autouse=True)
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide messages on one line, and any start of workers fails the test."""
    monkeypatch.setenv("COLUMNS", "200")

    def spawned(*args: object, **kwargs: object) -> None:
        raise AssertionError("workers were started for a value that should be refused")

    monkeypatch.setattr("plait.cli.train.launch", spawned)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plait: error: "), lines
    return lines[0]


BAD = [
    (["--lora-alpha", "16"], "--lora-alpha given without --lora-rank: LoRA is off"),
    (["--lora-dropout", "0.1", "--lora-targets", "q,v"],
     "--lora-dropout, --lora-targets given without --lora-rank"),
    (["--lora-rank", "0"], "--lora-rank must be >= 1, got 0"),
    (["--lora-rank", "-2"], "--lora-rank must be >= 1, got -2"),
    (["--model", "tiny-llama", "--lora-rank", "33", "--lora-targets", "all"],
     "--lora-rank 33 exceeds the width of attn.wk (64 -> 32): give at most 32"),
    (["--model", "tiny-llama", "--lora-rank", "4", "--lora-targets", "q,qq"],
     "unknown target 'qq' for this LLaMA model; known: q, k, v, o, gate, up, down"),
    (["--model", "tiny-gpt", "--lora-rank", "4", "--lora-targets", "gate"],
     "unknown target 'gate' for this GPT-2 model"),
    (["--model", "tiny-gpt", "--lora-rank", "4", "--lora-targets", "q,v,o"],
     "GPT-2 computes q, k and v in one projection (c_attn); target all three"),
]  # fmt: skip


@pytest.mark.parametrize("command", ["train", "estimate"])
@pytest.mark.parametrize(("flags", "words"), BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_lora_flags_are_one_line(command, flags, words, capsys):
    assert words in refused([command, *flags], capsys)


def test_lora_options_in_toml_without_rank(tmp_path: Path, capsys):
    config = tmp_path / "c.toml"
    config.write_text('[model]\npreset = "tiny-llama"\n[lora]\ntargets = "all"\n')
    assert "--lora-targets given without --lora-rank" in refused(
        ["estimate", "--config", str(config)], capsys
    )
    config.write_text('[model]\npreset = "tiny-llama"\n[lora]\nrank = 0\n')
    assert "lora.rank must be >= 1, got 0" in refused(["estimate", "--config", str(config)], capsys)


def test_model_validate_names_the_target():
    cfg = build_config(
        "tiny-llama",
        {
            "lora": {"rank": 33, "targets": "v"},
        },
    )
    with pytest.raises(ConfigError, match=r"^--lora-rank 33 exceeds the width of attn.wv"):
        cfg.model.validate()


def test_good_lora_flags_estimate(capsys):
    argv = ["estimate", "--model", "tiny-llama", "--lora-rank", "4", "--lora-alpha", "8"]
    assert main([*argv, "--lora-targets", "attn", "--lora-dropout", "0.05", "--json"]) == 0
    assert '"frozen_base"' in capsys.readouterr().out
