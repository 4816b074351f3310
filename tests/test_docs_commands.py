"""Every `plait` command line in README.md and docs/ runs as written (nothing trained).

Every line reaches plait as `.venv/bin/plait`, where the README's `make` installs it (the
README says so once; a bare `plait` is refused here), and every model, adapter or checkpoint
a line reads is one an earlier line writes. Each line of a fenced code block that runs
`.venv/bin/plait` is run by the real
`plait.cli.main` in a folder of its own, which holds what the docs' earlier lines would have
made (tests/docs_scratch: the configs, a stand-in corpus, a tokenizer and shards prepared
from it, tiny Hugging Face folders), so relative paths resolve and nothing lands in the
checkout. Each must exit 0:

- `presets`, `estimate`, `schedule`, `plan`, `tokenizer`, `data` and `--help` lines run for
  real (they are cheap);
- `train` lines run every check `plait train` makes before its workers start (flags, config
  validation, the data, the Hugging Face folder, a checkpoint to resume, the output folder)
  and reach the launch, which is not run (minutes of training). Their folder already holds a
  run at `runs/default` (as after `make train`), so each line names its own `--out`, and no
  two lines share one unless the second continues the first (`--resume latest`);
- `lessons` lines (minutes of runs) are parsed and their request checked, as `plait lessons`
  does before running anything.

`calibrate` (minutes of measuring) and `checkpoint`, `eval`, `export`, `generate` and a `--resume`
of a named checkpoint (they read a run the docs trained earlier) are parsed only: that they
run is tested on runs made by the tests (test_plan_step_terms, test_checkpoint, test_hf,
test_eval).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import plait.cli.train as train_command
from docs_scratch import scratch_folder, shared_artifacts
from plait.cli import build_parser, main
from plait.config import Config
from plait.lessons.runner import check_request

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLAIT = re.compile(r"^(?:\.venv/bin/)?plait\s")
PARSED_ONLY = ("calibrate", "checkpoint", "eval", "export", "generate")


def _commands() -> list[tuple[str, list[str]]]:
    found = []
    for doc in DOCS:
        in_block = False
        for line in doc.read_text().splitlines():
            if line.lstrip().startswith("```"):
                in_block = not in_block
                continue
            if in_block and PLAIT.match(line.strip()):
                words = shlex.split(line.strip(), comments=True)
                found.append((f"{doc.name}: {line.strip()}", words[1:]))
    return found


COMMANDS = _commands()


def test_the_docs_have_commands() -> None:
    assert len(COMMANDS) >= 30


def _code_lines() -> list[tuple[str, str]]:
    """(where, line) of every line in a fenced block of README.md and docs/."""
    found = []
    for doc in DOCS:
        in_block = False
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_block = not in_block
            elif in_block:
                found.append((f"{doc.name}:{n}", line.strip()))
    return found


def test_every_line_reaches_plait_as_the_readme_says() -> None:
    """The README installs plait into .venv and says, once, that every line reaches it as
    `.venv/bin/plait`: a bare `plait` (exit 127 in a fresh shell) is nowhere, at the start
    of a line or after `&&`."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert readme.count("every command line here and in docs/ reaches it as `.venv/bin/plait`") == 1
    bare = [where for where, line in _code_lines()
            if re.search(r"(?:^|&&\s*)plait\s", line)]  # fmt: skip
    assert not bare, bare
    assert sum(".venv/bin/plait " in line for _, line in _code_lines()) >= len(COMMANDS)


def test_every_folder_a_line_reads_is_made_by_a_line() -> None:
    """A model, adapter or checkpoint a line reads (`--init-from`, `--adapter`,
    `--checkpoint`, `--resume`) is one an earlier line of the docs writes (its `--out`, or a
    checkpoint inside it), or `make train`'s runs/default: never a folder nothing makes."""
    outs = {_out(argv) for _, argv in COMMANDS if _out(argv)} | {"runs/default"}
    missing = []
    for where, argv in COMMANDS:
        for flag in ("--init-from", "--adapter", "--checkpoint", "--resume"):
            if flag in argv and argv[argv.index(flag) + 1] != "latest":
                given = argv[argv.index(flag) + 1].rstrip("/")
                if not any(given == o or given.startswith(o + "/") for o in outs):
                    missing.append(f"{where}: {flag} {given}")
    assert not missing, missing


def _out(argv: list[str]) -> str | None:
    return argv[argv.index("--out") + 1].rstrip("/") if "--out" in argv else None


TRAINS = [(where, argv) for where, argv in COMMANDS if argv[0] == "train" and "--help" not in argv]


def test_every_train_line_names_its_own_out() -> None:
    """A line without `--out` writes `runs/default`, which `make train` (or the line before)
    already filled: `plait train` refuses it. Two lines sharing a folder clash the same way,
    unless the second continues the first's run (`--resume latest`)."""
    assert not [where for where, argv in TRAINS if _out(argv) is None]
    starts = [_out(argv) for _, argv in TRAINS if "latest" not in argv]
    assert len(starts) == len(set(starts)), sorted(o for o in starts if starts.count(o) > 1)
    assert "runs/default" not in starts


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    return shared_artifacts(tmp_path_factory.mktemp("docs-artifacts"), ROOT)


def _train_checks(argv: list[str], monkeypatch) -> list[Config]:
    """`plait train ARGV` up to the launch of its workers; returns what it would launch."""
    launched: list[Config] = []
    monkeypatch.setattr(train_command, "launch", launched.append)
    assert main(argv) == 0
    return launched


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_command_runs(where: str, argv: list[str], artifacts, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(scratch_folder(tmp_path, artifacts, argv))
    command = argv[0]
    if "--help" in argv:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0, where
        return
    if command in PARSED_ONLY:
        build_parser().parse_args(argv)
        return
    if command == "lessons":  # minutes of real runs: parsed and its request checked
        args = build_parser().parse_args(argv)
        check_request(args.only, Path(args.out))
        return
    if command != "train":
        assert main(argv) == 0, where
        return
    if "--resume" in argv and argv[argv.index("--resume") + 1] != "latest":
        i = argv.index("--resume")  # a run the docs trained earlier: test_checkpoint resumes
        del argv[i : i + 2]
    launched = _train_checks(argv, monkeypatch)
    assert len(launched) == 1, where
