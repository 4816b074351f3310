"""Every command's `--out`, in-process: a path that cannot be written is one line naming it,
exit code 2, before anything runs, and nothing is left behind (`plait.outdir` holds the rule).
Also the modes of written models and `checkpoint consolidate`'s refusal to replace a file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import plait.cli.train as train_command
from plait.cli import main
from plait.models.hf.export import write_folder
from plait.models.presets import get_preset
from plait.models.transformer import Transformer

UNWRITABLE = "/proc/plait-no-such"  # /proc refuses a new file or folder even to root

# Each command with --out: its argv ("OUT" is replaced) and whether --out is a file or folder.
FILE_COMMANDS = {
    "plan": ["plan", "--model", "tiny-gpt", "--gpus", "2", "--global-batch", "8",
             "--seq-len", "32", "--out", "OUT"],
    "calibrate": ["calibrate", "--out", "OUT"],
    "checkpoint consolidate": ["checkpoint", "consolidate", "{IN}/ckpt", "--out", "OUT"],
    "tokenizer train": ["tokenizer", "train", "--data", "{IN}/corpus.txt", "--vocab-size",
                        "300", "--no-progress", "--out", "OUT"],
}  # fmt: skip
FOLDER_COMMANDS = {
    "schedule": ["schedule", "--pp", "2", "--microbatches", "4", "--out", "OUT"],
    "export": ["export", "--checkpoint", "{IN}/ckpt", "--out", "OUT"],
    "data prepare": ["data", "prepare", "--data", "{IN}/corpus.txt", "--workers", "1",
                     "--no-progress", "--out", "OUT"],
    "lessons": ["lessons", "--quick", "--only", "dp", "--out", "OUT"],
    "train": ["train", "--model", "tiny-gpt", "--seq-len", "32", "--data", "{IN}/corpus.txt",
              "--out", "OUT"],
}  # fmt: skip

# (case, the --out under the test folder T, a phrase of the message); "afile" is a file and
# "adir" a folder holding one file, both made before the command runs.
FILE_CASES = [
    ("missing parent", "T/nope/x.out", "its folder 'T/nope' does not exist"),
    ("parent is a file", "T/afile/x.out", "its folder 'T/afile' is a file"),
    ("unwritable", UNWRITABLE, "cannot be written"),
    ("a folder", "T/adir", "is a folder; give a file path"),
    ("unwritable parent", f"{UNWRITABLE}/x.out", "its folder '/proc/plait-no-such' does not exist"),
]
FOLDER_CASES = [
    ("missing parent", "T/afile/sub/run", "cannot be made: 'T/afile' is a file"),
    ("unwritable", UNWRITABLE, "cannot be written"),
    ("a file", "T/afile", "is a file; give a folder"),
    ("unwritable parent", f"{UNWRITABLE}/sub", "cannot be written"),
]
EXISTING = {  # an existing output each command refuses to replace unless asked
    "checkpoint consolidate": ("T/afile", "already exists; add --overwrite to replace it"),
    "export": ("T/adir", "already exists and is not an empty folder"),
    "data prepare": ("T/adir", "exists; add --overwrite to replace it"),
    "train": ("T/arun", "already holds a run"),
}
TABLE = [
    (cmd, case, out, phrase)
    for commands, cases in ((FILE_COMMANDS, FILE_CASES), (FOLDER_COMMANDS, FOLDER_CASES))
    for cmd in commands
    for case, out, phrase in cases
] + [(cmd, "existing", out, phrase) for cmd, (out, phrase) in EXISTING.items()]


def listing(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with a file's bytes: the before/after of a refused command."""
    return {str(p): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """T: a file, a non-empty folder and a run folder; IN: a small corpus. Launching workers
    fails the test (every refusal comes before)."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(train_command, "launch", lambda cfg: pytest.fail("workers started"))
    (tmp_path / "T" / "adir").mkdir(parents=True)
    (tmp_path / "T" / "adir" / "kept.txt").write_text("mine")
    (tmp_path / "T" / "afile").write_text("mine")
    (tmp_path / "T" / "arun").mkdir()
    (tmp_path / "T" / "arun" / "summary.json").write_text("{}")
    (tmp_path / "IN").mkdir()
    (tmp_path / "IN" / "corpus.txt").write_text("the quick brown fox jumps over it.\n" * 200)
    return tmp_path


@pytest.mark.parametrize(("command", "case", "out", "phrase"), TABLE)
def test_every_bad_out_is_one_line_and_leaves_nothing(tree, capsys, command, case, out, phrase):
    commands = {**FILE_COMMANDS, **FOLDER_COMMANDS}
    out = out.replace("T", str(tree / "T"), 1) if out.startswith("T") else out
    argv = [out if a == "OUT" else a.replace("{IN}", str(tree / "IN")) for a in commands[command]]
    before = listing(tree)
    assert main(argv) == 2, (command, case)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plait: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert repr(out) in lines[0], lines[0]
    assert phrase.replace("T/", f"{tree}/T/") in lines[0], lines[0]
    assert listing(tree) == before


def test_data_prepare_refuses_shard_tokens_0_before_making_anything(tree, capsys) -> None:
    argv = ["data", "prepare", "--data", str(tree / "IN" / "corpus.txt"), "--shard-tokens", "0"]
    before = listing(tree)
    assert main([*argv, "--workers", "1", "--out", str(tree / "shards")]) == 2
    assert "--shard-tokens must be >= 1, got 0" in capsys.readouterr().err
    assert listing(tree) == before


def _fake_checkpoint(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """consolidate's reads replaced: the test is about the file it writes."""
    weights = {"w": torch.full((3,), float(step))}
    monkeypatch.setattr("plait.checkpoint.store.complete", lambda path: path)
    monkeypatch.setattr("plait.checkpoint.inspect.read_params", lambda path: weights)
    monkeypatch.setattr("plait.checkpoint.store.read_trainer", lambda path: {"step": step})


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600)])
def test_consolidate_writes_the_usual_mode(tmp_path, monkeypatch, capsys, mask, mode) -> None:
    _fake_checkpoint(monkeypatch, 3)
    out = tmp_path / "model.safetensors"
    old = os.umask(mask)
    try:
        assert main(["checkpoint", "consolidate", str(tmp_path / "ck"), "--out", str(out)]) == 0
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_consolidate_replaces_a_file_only_with_overwrite(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"another model")
    _fake_checkpoint(monkeypatch, 5)
    argv = ["checkpoint", "consolidate", str(tmp_path / "ck"), "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--out {str(out)!r} already exists; add --overwrite to replace it" in err
    assert out.read_bytes() == b"another model"
    assert main([*argv, "--overwrite"]) == 0
    assert torch.equal(load_file(str(out))["w"], torch.full((3,), 5.0))


@pytest.mark.parametrize(("mask", "dirs", "files"), [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_export_writes_the_usual_modes(tmp_path, mask, dirs, files) -> None:
    cfg = get_preset("tiny-gpt")
    params = {name: p.detach() for name, p in Transformer(cfg).named_parameters()}
    old = os.umask(mask)
    try:
        write_folder(cfg, params, tmp_path / "hf")
    finally:
        os.umask(old)
    assert (tmp_path / "hf").stat().st_mode & 0o777 == dirs
    written = list((tmp_path / "hf").iterdir())
    assert {p.name for p in written} >= {"config.json", "model.safetensors"}
    assert {p.stat().st_mode & 0o777 for p in written} == {files}


@pytest.mark.parametrize(
    "argv",
    [["checkpoint", "info", "F"], ["export", "--checkpoint", "F", "--out", "T/hf"],
     ["train", "--resume", "F", "--out", "T/run"]],
)  # fmt: skip
def test_a_file_given_as_a_checkpoint_is_named_a_file(tree, capsys, argv) -> None:
    (tree / "F").write_text("not a checkpoint")
    argv = [str(tree / a) if a in ("F", "T/hf", "T/run") else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {str(tree / 'F')!r} is a file; give a checkpoint folder" in err
