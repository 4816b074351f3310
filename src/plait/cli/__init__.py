"""The `plait` command line: one module per command, parsing and printing only; each hands
typed configs down to the part that does the work.

  dispatch.py    the parser of every command and the dispatch (`plait --help`)
  run_flags.py   the flags of a run, generated from `plait.config`'s dataclasses; TOML files
  train.py       `plait train`: validate everything, then `plait.launch`
  estimate.py    `plait estimate` (`plait.estimate`)
  plan.py        `plait plan` (`plait.plan`)
  calibrate.py   `plait calibrate` (`plait.calibrate`)
  presets.py     `plait presets`
  schedule.py    `plait schedule` (`plait.schedule`)
  checkpoint.py  `plait checkpoint info|consolidate` (`plait.checkpoint.inspect`)
  data.py        `plait tokenizer train`, `plait data prepare` (`plait.data`)
  models.py      `plait export`, `plait generate`, and `--init-from` (`plait.models.hf`)
  lessons.py     `plait lessons` (`plait.lessons`)
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import nullcontext
from typing import Any

from plait.signals import exit_code, pause_at, stopping_raised

__all__ = ["build_parser", "config_from_args", "main"]


def main(argv: list[str] | None = None) -> int:
    """The `plait` entry point. Importing the commands (torch among them) takes seconds, and a
    Ctrl-C in that time would print the import's traceback; so this module stays light, and
    an interrupt before the command's own handling starts ends in one line and exit 130.
    SIGTERM is taken the same way (`plait.signals.Stopping`, exit 143): a command without
    workers cleans up what it was writing, as on Ctrl-C, instead of dying mid-file."""
    main_thread = threading.current_thread() is threading.main_thread()
    try:
        with stopping_raised() if main_thread else nullcontext():
            pause_at("start", "plait")  # test hook: a test signals here, deterministically
            from plait.cli.dispatch import main as run

            return run(argv)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {e}"
        print(f"plait: {what}; nothing more runs.", file=sys.stderr)
        return exit_code(signum)


def __getattr__(name: str) -> Any:
    """`build_parser` and `config_from_args`, imported when first asked for (PEP 562)."""
    if name == "build_parser":
        from plait.cli.dispatch import build_parser

        return build_parser
    if name == "config_from_args":
        from plait.cli.run_flags import config_from_args

        return config_from_args
    raise AttributeError(f"module 'plait.cli' has no attribute {name!r}")
