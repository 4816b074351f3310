"""What used to run silently wrong now does the right thing or stops in one line, exit 2, before
any worker: `--init-from DIR` reads text with DIR's tokenizer (a --tokenizer or shards of
another refused), a config.json with a quantization_config plait cannot read (all but QLoRA's
NF4 with double quantization: models/nf4/hf.py) is refused naming the scheme, a
second `--data` is refused rather than replacing the first, and an empty `--lora-targets` is
refused rather than standing for PEFT's default. No process is started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from hf_models import llama_config, save
from instruct_data import tokenizer_folder
from plait.cli import main
from plait.config import Config
from plait.data.prepare import PrepareJob, prepare
from plait.data.stream import load_stream
from plait.data.tokenizer import Encoder, resolve_tokenizer

RUN = ["--seq-len", "16", "--global-batch", "2", "--micro-batch", "1", "--steps", "1",
       "--no-progress", "--device", "cpu"]  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny Llama folder with its own tokenizer (400 tokens), as the hub ships them."""
    folder = save(llama_config(vocab=400), tmp_path_factory.mktemp("hf") / "llama")
    return tokenizer_folder(folder, None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    return path


def _launched(argv: list[str], monkeypatch, capsys) -> Config:
    launched: list[Config] = []
    monkeypatch.setattr("plait.cli.train.launch", launched.append)
    assert main(["train", *argv]) == 0, capsys.readouterr().err
    return launched[0]


def _refused(argv: list[str], capsys) -> str:
    """Exit 2 and one line: from the command, or from the parser (argparse's SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return " ".join(err.split())


def test_init_from_reads_text_with_the_folders_tokenizer(
    model, corpus, tmp_path, monkeypatch, capsys
) -> None:
    cfg = _launched(["--init-from", str(model), "--data", str(corpus), "--out",
                     str(tmp_path / "r"), *RUN], monkeypatch, capsys)  # fmt: skip
    spec = resolve_tokenizer(model)
    assert cfg.data.tokenizer == str(model) and cfg.data.tokenizer_hash == spec.identity
    stream = load_stream(cfg.data.path, cfg.data.tokenizer, cfg.data.max_bytes)
    assert list(stream) == list(Encoder(spec).encode_text(corpus.read_bytes()))
    assert max(stream) >= 256  # merged tokens: not the byte ids this run used to read
    cfg = _launched(["--init-from", str(model), "--data", str(corpus), "--tokenizer", str(model),
                     "--out", str(tmp_path / "r2"), *RUN], monkeypatch, capsys)  # fmt: skip
    assert cfg.data.tokenizer_hash == spec.identity


def test_another_tokenizer_or_its_shards_are_refused(model, corpus, tmp_path, capsys) -> None:
    other = tokenizer_folder(tmp_path / "other", None, model_max_length=99)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + " ")
    base = ["train", "--init-from", str(model), "--out", str(tmp_path / "r"), *RUN]
    said = _refused([*base, "--data", str(corpus), "--tokenizer", str(other)], capsys)
    assert f"--tokenizer {other} is not --init-from {model}'s tokenizer (sha256" in said
    assert "leave --tokenizer out" in said
    for name, tok in (("bytes", None), ("other", str(other))):
        shards = tmp_path / f"shards-{name}"
        prepare(PrepareJob(str(corpus), shards, tok))
        said = _refused([*base, "--data", str(shards)], capsys)
        assert f"shards {str(shards)!r} were made with tokenizer" in said
        assert f"not with --init-from {model}'s; prepare them again with --tokenizer" in said
    assert not (tmp_path / "r").exists()


def test_a_quantized_folder_is_refused_naming_the_method(model, corpus, tmp_path, capsys) -> None:
    folder = tmp_path / "nf4"
    folder.mkdir()
    for f in model.iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                     "bnb_4bit_quant_type": "nf4"}  # fmt: skip
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    want = (f"{folder / 'config.json'}: quantization_config is bitsandbytes 4-bit nf4 "
            "without double quantization; plait reads only bitsandbytes NF4 with double "
            "quantization (QLoRA's format) or an unquantized folder")  # fmt: skip
    for argv in (["train", "--init-from", str(folder), "--data", str(corpus), "--out",
                  str(tmp_path / "r"), *RUN],
                 ["eval", "--init-from", str(folder), "--data", str(corpus), "--seq-len", "16"],
                 ["generate", "--init-from", str(folder), "--prompt", "x"],
                 ["estimate", "--init-from", str(folder)]):  # fmt: skip
        assert want in _refused(argv, capsys), argv
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3"}
    (folder / "config.json").write_text(json.dumps(config))
    said = _refused(["estimate", "--init-from", str(folder)], capsys)
    assert "quantization_config is FP8; plait reads only bitsandbytes NF4" in said


def test_a_second_data_is_refused_not_kept_instead(corpus, tmp_path, capsys) -> None:
    other = tmp_path / "b.txt"
    other.write_text("other text " * 100)
    twice = ["--data", str(corpus), "--data", str(other)]
    want = f"--data given twice ({str(corpus)!r}, then {str(other)!r}): a run reads one source"
    for argv in (["train", *twice, "--out", str(tmp_path / "r")],
                 ["eval", "--init-from", str(tmp_path), *twice],
                 ["estimate", *twice],
                 ["data", "prepare", *twice, "--out", str(tmp_path / "s")],
                 ["tokenizer", "train", *twice, "--vocab-size", "300", "--out",
                  str(tmp_path / "t.json")]):  # fmt: skip
        assert want in _refused(argv, capsys), argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt"]


def test_an_empty_lora_targets_is_refused(tmp_path, capsys, monkeypatch) -> None:
    want = "--lora-targets '' names no target: leave it out for PEFT's default"
    run = ["train", "--model", "tiny-llama", "--lora-rank", "4", "--out", str(tmp_path / "r")]
    for targets in ("", " ", ","):
        said = _refused([*run, "--lora-targets", targets], capsys)
        assert f"--lora-targets {targets!r} names no target" in said
    toml = tmp_path / "lora.toml"
    toml.write_text('[model]\npreset = "tiny-llama"\n[lora]\nrank = 4\ntargets = ""\n')
    assert want in _refused(["train", "--config", str(toml), "--out", str(tmp_path / "r")], capsys)
    plan = ["plan", "--model", "tiny-llama", "--gpus", "2", "--global-batch", "4", "--seq-len",
            "64", "--lora-rank", "4"]  # fmt: skip
    assert want in _refused([*plan, "--lora-targets", ""], capsys)
    out = tmp_path / "plan.toml"
    assert main([*plan, "--out", str(out)]) == 0
    capsys.readouterr()
    assert "lora_targets" not in out.read_text()  # PEFT's default: the key left out
    monkeypatch.setattr("plait.cli.train.launch", lambda cfg: None)
    assert main(["train", "--config", str(out), "--out", str(tmp_path / "p"), "--steps", "1"]) == 0
