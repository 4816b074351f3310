"""Bad input to a QLoRA run stops before any worker starts: one line naming the values, exit 2.

`--base-dtype nf4` without LoRA, or with an engine that does not hold it (naive data
parallelism, 2BW), or a tensor-parallel cut through a 64-weight block; `--base-upcast` under
fp32 or with a 16-bit gradient reduction; a
folder quantized with another scheme than bitsandbytes' NF4 with double quantization (fp4,
NF4 without double quantization, 8-bit, GPTQ, AWQ); a folder saved 4-bit trained without
`--base-dtype nf4`. (fp32, bf16 and fp16 all compute over an NF4 base: none is refused.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from hf_models import llama_config, save
from plait.cli import main

RUN = ["--steps", "1", "--seq-len", "16", "--global-batch", "2", "--micro-batch", "1",
       "--no-progress", "--device", "cpu"]  # fmt: skip
NF4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
       "bnb_4bit_use_double_quant": True}  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save(llama_config(intermediate_size=128), tmp_path_factory.mktemp("base") / "llama")


def quantized(base: Path, where: Path, config: dict) -> Path:
    """A copy of `base` whose config.json says it was quantized with `config`."""
    folder = where / "quantized"
    shutil.copytree(base, folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(hf | {"quantization_config": config}))
    return folder


def refused(argv: list[str], tmp_path: Path, capsys) -> str:
    run = tmp_path / "run"
    assert main(["train", *argv, "--out", str(run), *RUN]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not run.exists()
    return err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "--base-dtype nf4 quantizes a frozen base to 4 bits (QLoRA), and only LoRA's "
             "adapters train over it: give --lora-rank R"),
        (["--lora-rank", "4", "--dp", "2", "--dp-mode", "naive"],
         "--base-dtype nf4 is held by the ZeRO engine only; --dp-mode naive keeps the base"),
        (["--lora-rank", "4", "--pp", "2", "--schedule", "2bw", "--microbatches", "2",
          "--global-batch", "2"],
         "--base-dtype nf4 is held by the ZeRO engine only; --schedule 2bw keeps the base"),
        (["--lora-rank", "4", "--tp", "2"],
         "--base-dtype nf4 with --tp 2 cuts attn.wo (64 -> 64) by input features into slices "
         "that are not whole 64-weight NF4 blocks: give a --tp that divides it into multiples "
         "of 64"),
        (["--lora-rank", "4", "--base-upcast"],
         "--base-upcast computes in fp32 beside an NF4 base's 16-bit products: it needs "
         "--base-dtype nf4 and --precision bf16 or fp16 (got --base-dtype nf4, --precision "
         "fp32)"),
        (["--lora-rank", "4", "--base-upcast", "--precision", "bf16", "--reduce-dtype", "bf16"],
         "--base-upcast's gradients are fp32 and reduce in fp32; got --reduce-dtype bf16"),
    ],
    ids=["no-lora", "naive", "2bw", "tp-cut", "upcast-fp32", "upcast-reduce"],
)  # fmt: skip
def test_nf4_needs_lora_and_the_zero_engine(base, tmp_path, capsys, flags, message) -> None:
    argv = ["--init-from", str(base), "--base-dtype", "nf4", *flags]
    assert message in refused(argv, tmp_path, capsys)


@pytest.mark.parametrize(
    ("config", "scheme"),
    [
        (NF4 | {"bnb_4bit_quant_type": "fp4"}, "bitsandbytes 4-bit fp4"),
        (NF4 | {"bnb_4bit_use_double_quant": False},
         "bitsandbytes 4-bit nf4 without double quantization"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True},
         "bitsandbytes 8-bit (load_in_8bit)"),
        ({"quant_method": "gptq", "bits": 4}, "GPTQ"),
        ({"quant_method": "awq", "bits": 4}, "AWQ"),
    ],
    ids=["fp4", "nf4-single", "int8", "gptq", "awq"],
)  # fmt: skip
def test_another_quantization_is_named(base, tmp_path, capsys, config, scheme) -> None:
    folder = quantized(base, tmp_path, config)
    for extra in ([], ["--base-dtype", "nf4"]):
        err = refused(["--init-from", str(folder), "--lora-rank", "4", *extra], tmp_path, capsys)
        assert (
            f"config.json: quantization_config is {scheme}; plait reads only bitsandbytes "
            "NF4 with double quantization (QLoRA's format) or an unquantized folder" in err
        )


def test_a_4bit_folder_needs_base_dtype_nf4(base, tmp_path, capsys) -> None:
    folder = quantized(base, tmp_path, NF4)
    for flags in (["--lora-rank", "4"], ["--lora-rank", "4", "--base-dtype", "bf16"], []):
        err = refused(["--init-from", str(folder), *flags], tmp_path, capsys)
        assert (
            f"--init-from {folder} is saved 4-bit (bitsandbytes NF4): train LoRA adapters "
            "on it with --lora-rank R --base-dtype nf4" in err
        )


def test_a_qlora_checkpoint_resumes_on_its_quantized_base_only(tmp_path) -> None:
    """A checkpoint names its base's quantization; resuming NF4-trained adapters on the
    unquantized base (or the reverse) is refused, naming both."""
    from plait.checkpoint.base import base_record, check_same_adapters_and_base
    from plait.errors import ConfigError

    def config(base_dtype: str) -> dict:
        model = {"lora_rank": 4, "lora_targets": "all", "lora_alpha": 8.0}  # the model's record
        return {"model": model, "lora": {"base_dtype": base_dtype}, "train": {"seed": 3},
                "checkpoint": {}}  # fmt: skip

    saved = {"config": config("nf4"), "base": base_record(config("nf4"))}
    assert saved["base"] == {"init_from": None, "sha256": None, "seed": 3,
                             "quantization": "nf4"}  # fmt: skip
    check_same_adapters_and_base(tmp_path, saved, config("nf4"))
    with pytest.raises(
        ConfigError,
        match=r"adapters trained on the seeded init \(seed 3\), "
        r"quantized to NF4; this run's base is the seeded init \(seed 3\) ",
    ):
        check_same_adapters_and_base(tmp_path, saved, config("bf16"))
