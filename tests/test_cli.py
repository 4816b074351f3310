"""Tests for plait.cli, in-process: errors, precedence, flags, presets and one tiny real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli import build_parser, config_from_args, main
from plait.models.presets import preset_names
from plait.outdir import prepare_out


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich wraps to the terminal width; a wide one keeps messages on one line."""
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A few KB of text: enough windows for seq_len 32, far quicker than the stdlib."""
    path = tmp_path / "corpus.txt"
    line = "Pack my box with five dozen liquor jugs; the quick brown fox jumps over it.\n"
    path.write_text(line * 60)  # 4,620 bytes
    return path


def config_of(argv: list[str]):
    return config_from_args(build_parser().parse_args(argv))


def error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run main, expect the ConfigError exit code 2, return stderr on one line."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = " ".join(captured.err.split())
    assert err.startswith("plait: error: "), err
    return err


# --- errors -------------------------------------------------------------------------------


def test_unknown_preset_lists_known_presets(capsys: pytest.CaptureFixture[str]) -> None:
    err = error_of(["train", "--model", "nope"], capsys)
    assert "unknown model preset 'nope'" in err
    for name in preset_names():
        assert name in err


def test_batch_arithmetic_error(capsys: pytest.CaptureFixture[str], corpus: Path) -> None:
    argv = ["train", "--model", "tiny-gpt", "--seq-len", "32", "--data", str(corpus)]
    argv += ["--global-batch", "10", "--micro-batch", "4", "--dp", "2"]
    err = error_of(argv, capsys)
    assert "global batch 10 is not a multiple of micro-batch 4 x dp 2 = 8" in err


def test_missing_data_path(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--model", "tiny-gpt", "--seq-len", "32", "--data", "/nonexistent"]
    err = error_of(argv, capsys)
    assert "'/nonexistent' does not exist" in err


def test_missing_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    err = error_of(["train", "--config", str(missing)], capsys)
    assert f"config file '{missing}' does not exist" in err


def test_a_word_for_a_number_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--steps", "three"]) == 2
    err = capsys.readouterr().err
    assert err == "plait: error: --steps must be an integer >= 1, got 'three'\n"


# --- precedence and flags -----------------------------------------------------------------


def test_flags_beat_toml_beat_preset(tmp_path: Path, corpus: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(
        '[model]\npreset = "tiny-gpt"\nn_layers = 3\n\n'
        "[train]\nsteps = 3\nseq_len = 32\n\n[optim]\nlr = 0.001\n\n"
        f"[data]\npath = {json.dumps(str(corpus))}\n"
    )
    base = ["train", "--config", str(toml)]
    cfg = config_of(base)
    assert cfg.preset == "tiny-gpt"
    assert cfg.model.n_layers == 3  # TOML beats the preset's 2
    assert cfg.model.d_model == 64  # preset value kept
    assert cfg.train.steps == 3 and cfg.optim.lr == 0.001
    assert cfg.data.path == str(corpus)

    cfg = config_of([*base, "--steps", "5", "--n-layers", "1"])
    assert cfg.train.steps == 5  # flag beats TOML
    assert cfg.model.n_layers == 1
    assert cfg.optim.lr == 0.001  # TOML value not named on the command line stays

    cfg = config_of([*base, "--model", "tiny-llama"])
    assert cfg.preset == "tiny-llama"  # --model beats the TOML preset
    assert cfg.model.norm == "rmsnorm"
    assert cfg.model.n_layers == 3  # TOML model overrides still apply on top


def test_default_preset_and_typed_flags(corpus: Path) -> None:
    argv = ["train", "--seq-len", "32", "--data", str(corpus), "--lr", "2e-3"]
    argv += ["--bucket-mb", "1.5", "--recompute", "full", "--n-kv-heads", "2"]
    cfg = config_of(argv)
    assert cfg.preset == "small-gpt"
    assert cfg.optim.lr == 2e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.parallel.bucket_mb == 1.5
    assert cfg.memory.recompute == "full"
    assert cfg.model.n_kv_heads == 2 and isinstance(cfg.model.n_kv_heads, int)
    assert cfg.data.path == str(corpus)


def test_boolean_flags(corpus: Path) -> None:
    base = ["train", "--model", "tiny-gpt", "--seq-len", "32", "--data", str(corpus)]
    cfg = config_of(base)
    assert cfg.log.progress is True and cfg.log.tensorboard is False
    assert cfg.model.tie_embeddings is True
    cfg = config_of([*base, "--no-progress", "--tensorboard", "--no-tie-embeddings"])
    assert cfg.log.progress is False
    assert cfg.log.tensorboard is True
    assert cfg.model.tie_embeddings is False
    assert config_of([*base, "--progress"]).log.progress is True


def test_flags_not_given_leave_defaults_untouched(corpus: Path) -> None:
    args = build_parser().parse_args(["train", "--model", "tiny-gpt", "--steps", "4"])
    given = {k: v for k, v in vars(args).items() if "." in k}
    assert given == {"train.steps": 4}  # SUPPRESS: only named flags become overrides


# --- presets ------------------------------------------------------------------------------


def test_presets_lists_every_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in preset_names():
        assert name in out
    assert "124,439,808" in out  # gpt2's published parameter count, formatted


# --- a real run ---------------------------------------------------------------------------


def run_argv(out: Path, corpus: Path) -> list[str]:
    return [
        "train",
        "--model",
        "tiny-gpt",
        "--steps",
        "3",
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--micro-batch",
        "2",
        "--eval-batches",
        "1",
        "--data",
        str(corpus),
        "--out",
        str(out),
        "--no-progress",
        "--device",
        "cpu",
    ]


def test_tiny_training_run_writes_metrics_summary_and_config(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "run"
    assert main(run_argv(out, corpus)) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
            assert isinstance(r[key], float) and r[key] > 0, (key, r)
        assert 4.0 < r["loss"] < 7.0  # near ln(256) = 5.55 for an untrained byte model
    assert [r["lr"] for r in rows] == pytest.approx([1e-4, 2e-4, 3e-4])  # warmup 3e-3/30
    assert "val_loss" in rows[-1]  # the last step always validates

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["final_loss"] == pytest.approx(rows[-1]["loss"])
    assert summary["val_loss"] == pytest.approx(rows[-1]["val_loss"])
    assert summary["tokens_per_step"] == 4 * 32

    config = json.loads((out / "config.json").read_text())
    assert config["preset"] == "tiny-gpt"
    assert config["train"]["steps"] == 3 and config["train"]["seq_len"] == 32
    assert config["data"]["path"] == str(corpus)


def test_tiny_training_run_with_tensorboard(tmp_path: Path, corpus: Path) -> None:
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    assert main([*run_argv(out, corpus), "--tensorboard"]) == 0
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_brackets_in_messages_survive(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Rich markup must not eat '[section]' or a gloo '[/path...]' in a message."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[optimizer]\nlr = 1.0\n")
    message = error_of(["train", "--config", str(bad)], capsys)
    assert "unknown config section [optimizer]" in message


def test_schedule_command_draws_and_reports(tmp_path: Path, capsys) -> None:
    argv = ["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0.2727" in out  # (p-1)/(m+p-1) = 3/11
    assert (tmp_path / "1f1b-p4-m8.png").stat().st_size > 0


def test_schedule_command_bad_sizes(capsys) -> None:
    argv = ["schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved"]
    message = error_of([*argv, "--virtual-stages", "2"], capsys)
    assert "m a multiple of p, got m=6, p=4" in message


def _binary(path: Path) -> Path:
    path.write_bytes(b"\x7fELF\x00\x01" * 2000)
    return path


BAD_INPUTS = [
    (lambda d: ["--data", str(d)], "holds no text (empty and binary files are skipped)"),
    (lambda d: ["--data", str(_binary(d / "code.bin"))], "is not text (it has NUL bytes"),
    (
        lambda d: ["--microbatches", "-1"],
        "--microbatches must be >= 0, got -1",
    ),
    (lambda d: ["--schedule", "gpipe"], "schedule 'gpipe' needs a pipeline (pp > 1); got pp=1"),
    (lambda d: ["--stage-layers", "1,1"], "stage_layers [1, 1] needs a pipeline (pp > 1)"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_before_workers(extra, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")  # a narrow terminal or a pipe must not wrap the line
    folder = tmp_path / "empty"
    folder.mkdir()
    _binary(folder / "blob.bin")  # a folder of binaries holds no text
    assert main(["train", *extra(folder)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("plait: error: ") and err.count("\n") == 1, err


def test_cuda_asked_for_without_cuda(capsys, monkeypatch) -> None:
    monkeypatch.setattr("plait.config.checks.cuda_available", lambda: False)
    err = error_of(["train", "--device", "cuda"], capsys)
    assert "device 'cuda' was asked for, but this torch sees no CUDA device" in err


def test_torchrun_world_must_match_before_workers(capsys, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    err = error_of(["train", "--dp", "2"], capsys)
    assert "world size 3 != dp*pp*tp = 2*1*1 = 2" in err


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("plait ")


def test_fp16_on_cpu_warns_once(capsys, monkeypatch, corpus: Path, tmp_path: Path) -> None:
    monkeypatch.setattr("plait.cli.train.launch", lambda cfg: None)  # validate and warn, no run
    monkeypatch.setattr("plait.config.schema.device_kind", lambda kind: "cpu")
    argv = [
        "train",
        "--precision",
        "fp16",
        "--data",
        str(corpus),
        "--seq-len",
        "32",
        "--out",
        str(tmp_path / "run"),
    ]  # its own folder: runs/default may hold `make train`'s run
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith("plait: warning: fp16 on a CPU") and "bf16" in err


def test_output_folder_holding_a_run_is_refused_or_replaced(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    (out / "tensorboard").mkdir()
    (out / "notes.txt").write_text("mine")  # not plait's: never removed
    err = error_of(["train", "--out", str(out)], capsys)
    assert f"output folder '{out}' already holds a run" in err and "--overwrite" in err
    assert (out / "summary.json").exists()
    prepare_out(out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_output_folder_that_cannot_be_written(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    err = error_of(["train", "--out", str(blocker / "run")], capsys)
    assert f"--out '{blocker / 'run'}' cannot be made: '{blocker}' is a file" in err
