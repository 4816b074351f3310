"""Every `plait` command line in README.md and docs/ is valid as written (nothing trained).

Each line of a fenced code block that runs `plait` (or `.venv/bin/plait`) is parsed by the
real command-line parser and validated the way `plait train` validates before it starts
workers; `plait schedule`, `plait estimate`, `plait plan` and `plait presets` lines run for
real (they are cheap); `plait calibrate` lines are parsed; `plait lessons` lines are parsed
and their lesson names checked.
"""

from __future__ import annotations

import re
import shlex
from contextlib import nullcontext
from pathlib import Path

import pytest

from plait.cli import build_parser, config_from_args, main
from plait.lessons.runner import check_request

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLAIT = re.compile(r"^(?:\.venv/bin/)?plait\s")


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


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_command_is_valid(where: str, argv: list[str], tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # configs/... paths are relative to the repository
    if "--help" in argv or argv[0] == "presets":
        with pytest.raises(SystemExit) if "--help" in argv else nullcontext():
            main(argv)
        return
    if argv[0] in ("calibrate", "checkpoint", "tokenizer", "data", "export", "generate"):
        build_parser().parse_args(argv)
        return
    if argv[0] == "plan":  # pure: run it for real, writing its TOML to a temporary folder
        if "--out" in argv:
            argv[argv.index("--out") + 1] = str(tmp_path / "plan.toml")
        assert main(argv) == 0, where
        return
    if argv[0] == "lessons":  # minutes of real runs: parsed and its request checked, not run
        check_request(build_parser().parse_args(argv).only, tmp_path)
        return
    if "--tokenizer" in argv and not Path(argv[argv.index("--tokenizer") + 1]).exists():
        build_parser().parse_args(argv)  # names a tokenizer trained by a line above
        return
    if argv[0] == "estimate":  # pure and cheap: run it for real
        assert main(argv) == 0, where
        return
    if argv[0] == "schedule":
        if "--out" in argv:  # write the chart to a temporary folder, not into the checkout
            argv[argv.index("--out") + 1] = str(tmp_path)
        assert main(argv) == 0, where
        return
    for flag in ("--resume", "--init-from"):  # an earlier run, a Hugging Face folder: tested
        if flag in argv:  # by test_checkpoint and test_hf
            i = argv.index(flag)
            del argv[i : i + 2]
    if "--data" in argv and not Path(argv[argv.index("--data") + 1]).exists():
        placeholder = tmp_path / "corpus.txt"  # `my_corpus/` stands for the reader's text
        placeholder.write_text("plait reads text. " * 20_000)
        argv[argv.index("--data") + 1] = str(placeholder)
    config_from_args(build_parser().parse_args(argv))  # raises ConfigError when invalid
