"""The run folder (`--out`): checked and cleared before any worker starts.

A run writes `config.json`, `metrics.jsonl`, `summary.json`, `tensorboard/` and pipeline
charts into its folder. Starting a second run there would mix two runs' files (a failed run
beside the previous run's `summary.json`), so a folder that holds a run is refused unless
`--overwrite` asks for its files to go first. Only the files plait writes are removed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from plait.errors import ConfigError

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json")
RUN_DIRS = ("tensorboard", "checkpoints")
RUN_GLOBS = ("pipeline-*",)


def previous_run(out: Path) -> list[Path]:
    """The files and folders of an earlier run inside `out` (empty: none)."""
    if not out.is_dir():
        return []
    found = [out / name for name in (*RUN_FILES, *RUN_DIRS) if (out / name).exists()]
    found += [p for pattern in RUN_GLOBS for p in sorted(out.glob(pattern))]
    return found


def prepare_out(out: Path, overwrite: bool, resume: bool = False) -> None:
    """Refuse a folder holding a run (or clear it with `overwrite`; a resumed run continues
    it); make sure it is writable."""
    old = [] if resume else previous_run(out)
    if old and not overwrite:
        raise ConfigError(
            f"output folder {str(out)!r} already holds a run ({old[0].name}); give another "
            "--out, --resume latest to continue it, or --overwrite to replace it"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ConfigError(f"output folder {str(out)!r} cannot be written: {e.strerror}") from None
    for path in old:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
