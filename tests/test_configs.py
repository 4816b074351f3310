"""The shipped configs/*.toml: each one parses, validates and estimates; Stanford Alpaca's
recipe says what Stanford ran; a recipe's preset yields to `--init-from` of the same model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from plait.cli import config_from_args, main
from plait.cli.dispatch import build_parser
from plait.config import Config
from plait.data.packing import assign_rows, val_split
from plait.preflight import derive_steps

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
ALPACA = ROOT / "configs" / "alpaca-llama-7b.toml"
ALPACA_EXAMPLES = 52_002  # alpaca_data.json
LORA = ROOT / "configs" / "lora-llama-7b.toml"


def estimate_config(*argv: str) -> Config:
    """The config `plait estimate ARGV` runs (the data is not read, as estimate does not)."""
    return config_from_args(build_parser().parse_args(["estimate", *argv]), check_data=False)


def recipe_steps(cfg: Config) -> int:
    """The steps `plait train` derives from the recipe's --epochs over alpaca_data.json's
    52,002 examples (each shorter than a row, as at 512 tokens): the split and rows that
    `check_examples` counts, then `derive_steps`, the arithmetic a run prints first."""
    d, t = cfg.data, cfg.train
    lengths = np.full(ALPACA_EXAMPLES, 200, dtype=np.int64)
    train_ids, _ = val_split(ALPACA_EXAMPLES, d.val_fraction)
    rows = assign_rows(train_ids, lengths[train_ids], lengths[train_ids] // 2, t.seq_len, d.pack,
                     d.long).rows  # fmt: skip
    derive_steps(t, cfg.optim, rows)
    return t.steps


def test_the_configs_folder_holds_the_recipes() -> None:
    names = {p.name for p in CONFIGS}
    assert {"alpaca-llama-7b.toml", "finetune-stdlib.toml", "small-gpt-dp2.toml"} <= names
    assert "lora-llama-7b.toml" in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_estimates(path: Path, capsys) -> None:
    assert main(["estimate", "--config", str(path), "--json"]) == 0
    per_rank = json.loads(capsys.readouterr().out)["ranks"]
    assert per_rank and all(rank["total"]["device"] > 0 for rank in per_rank)


def test_alpaca_recipe_is_stanfords() -> None:
    """LLaMA-7B, lr 2e-5, 3 epochs of 52K at global batch 128, 512 tokens, bf16, warmup ratio
    0.03, no decay, cosine to 0, 4 GPUs fully sharded with micro-batch 4 and accumulation 8."""
    cfg = estimate_config("--config", str(ALPACA))
    m, par, t = cfg.model, cfg.parallel, cfg.train
    assert (m.n_layers, m.d_model, m.n_heads, m.vocab_size) == (32, 4096, 32, 32000)
    assert (par.dp, cfg.memory.zero, cfg.train.precision, par.tp, par.pp) == (4, 3, "bf16", 1, 1)
    assert (t.micro_batch, cfg.accumulation, t.global_batch, t.seq_len) == (4, 8, 128, 512)
    assert recipe_steps(cfg) == 3 * (ALPACA_EXAMPLES // t.global_batch) == 1218
    assert cfg.optim.warmup_steps == math.ceil(0.03 * 1218) == 37
    o = cfg.optim
    assert (o.lr, o.lr_schedule, o.min_lr, o.weight_decay, o.beta2) == (
        2e-5,
        "cosine",
        0.0,
        0.0,
        0.999,
    )


def test_alpaca_recipe_fits_stanfords_80_gib_gpus(capsys) -> None:
    """Memory per GPU above ZeRO-3's closed form for the model states (16 bytes per
    parameter over 4 ranks: activations and buffers come on top) and under an A100's 80 GiB."""
    assert main(["estimate", "--config", str(ALPACA), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    device = max(rank["total"]["device"] for rank in report["ranks"])
    assert 16 * report["psi"] / 4 < device < 80 * 2**30
    argv = ["estimate", "--config", str(ALPACA), "--device-memory", "24"]
    assert main(argv) == 2  # a 24 GiB card: refused, naming the need
    assert "nothing fits: pipeline stage 0 needs" in capsys.readouterr().err


def test_lora_recipe_is_alpaca_loras() -> None:
    """LLaMA-7B with Alpaca-LoRA's adapters (r 8, alpha 16, dropout 0.05, q and v), its
    batch (128 of micro-batches 4, 256 tokens) and schedule (lr 3e-4, 100 warmup steps, 3
    epochs of the 50,002 examples it trains on), on 4 GPUs under ZeRO-2 in bf16."""
    cfg = estimate_config("--config", str(LORA))
    m, par, t = cfg.model, cfg.parallel, cfg.train
    assert (m.n_layers, m.d_model, m.n_heads, m.vocab_size) == (32, 4096, 32, 32000)
    assert m.lora is not None and m.lora.leaves == ("attn.wq", "attn.wv")
    assert (m.lora_rank, m.lora.scaling, m.lora_dropout) == (8, 2.0, 0.05)
    assert (par.dp, cfg.memory.zero, cfg.train.precision, cfg.lora.base_dtype) == (
        4,
        2,
        "bf16",
        "auto",
    )
    assert (t.micro_batch, cfg.accumulation, t.global_batch, t.seq_len) == (4, 8, 128, 256)
    assert recipe_steps(cfg) == 3 * ((ALPACA_EXAMPLES - 2000) // t.global_batch) == 1170
    assert (cfg.optim.lr, cfg.optim.lr_schedule, cfg.optim.warmup_steps, cfg.optim.min_lr) == (
        3e-4,
        "linear",
        100,
        0.0,
    )


def test_lora_recipe_fits_24_gib_and_its_base_dominates_the_states(capsys) -> None:
    """The frozen bf16 base is 2 bytes per parameter on every rank (replicated under ZeRO-2);
    the adapters' states are 16 bytes per adapter parameter, sharded; all under 24 GiB."""
    assert main(["estimate", "--config", str(LORA), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rank = report["ranks"][0]
    lines = {line["name"]: line["device"] for line in rank["lines"]}
    assert lines["frozen_base"] == 2 * report["psi"]
    phi = report["reference"]["lora_phi"]
    assert phi == 32 * 8 * (4096 + 4096) * 2  # q and v: A (8, 4096) + B (4096, 8) each
    assert report["reference"]["lora_one_gpu"] == 2 * report["psi"] + 16 * phi
    assert lines["optimizer_states"] == pytest.approx(8 * phi / 4, rel=1e-3)  # ZeRO-2: 1/4
    assert lines["activations"] > 100 * lines["optimizer_states"]  # activations dominate
    assert rank["total"]["device"] < 24 * 2**30
    assert main(["estimate", "--config", str(LORA), "--device-memory", "16"]) == 2
    assert "nothing fits" in capsys.readouterr().err


def _recipe(tmp_path: Path, preset: str) -> Path:
    path = tmp_path / f"{preset}.toml"
    path.write_text(f'[model]\npreset = "{preset}"\ndropout = 0.0\n[train]\nseq_len = 32\n')
    return path


def test_a_recipes_preset_yields_to_init_from_of_the_same_model(tmp_path: Path, capsys) -> None:
    """`--config RECIPE --init-from FOLDER`: the file's preset sized the run for `estimate`;
    the folder is the model. Another architecture is one line, exit 2."""
    from hf_models import llama_config, save

    folder = save(llama_config(vocab=256), tmp_path / "hf")  # tiny-llama's shape
    cfg = estimate_config("--config", str(_recipe(tmp_path, "tiny-llama")), "--init-from",
                          str(folder))  # fmt: skip
    assert cfg.preset == f"hf:{folder}" and cfg.model.ffn_hidden == 96  # the folder's
    argv = ["estimate", "--config", str(_recipe(tmp_path, "small-llama")), "--init-from"]
    assert main([*argv, str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"the config file's preset 'small-llama' is not --init-from {folder}'s model: " in err
    assert "n_layers 4 vs 2, d_model 128 vs 64" in err
    argv = ["estimate", "--config", str(_recipe(tmp_path, "tiny-llama")), "--model", "tiny-gpt"]
    assert main([*argv, "--init-from", str(folder)]) == 2  # a flag's preset: still both named
    assert f"--model tiny-gpt and --init-from {folder} both name the model" in (
        capsys.readouterr().err
    )
