"""The `plait` command line: one module per command, parsing and printing only; each hands
typed configs down to the part that does the work.

  main.py        the parser of every command and the dispatch (`plait --help`)
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

from plait.cli.main import build_parser, main
from plait.cli.run_flags import config_from_args

__all__ = ["build_parser", "config_from_args", "main"]
