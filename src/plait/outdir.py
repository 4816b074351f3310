"""The run folder (`--out`): checked and cleared before any worker starts.

A run writes `config.json`, `metrics.jsonl`, `summary.json`, `tensorboard/` and pipeline
charts into its folder. Starting a second run there would mix two runs' files (a failed run
beside the previous run's `summary.json`), so a folder that holds a run is refused unless
`--overwrite` asks for its files to go first. Only the files plait writes are removed.

It is also the one home of the rule for every command's `--out`: `check_out_folder` and
`check_out_file` refuse, before anything is created or any worker starts, a path that cannot
be written (one line, exit 2), `publish` gives written files their usual modes, and
`atomic_file` and `atomic_folder` write a file or a folder whole or not at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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
    check_out_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    for path in old:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def _nearest(path: Path) -> Path:
    """`path` or its closest ancestor that exists (`.` for a relative path's missing root)."""
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return candidate
    return Path(".")


def _probe(folder: Path, flag: str, out: Path) -> None:
    """Create and drop a file in `folder`: the only sure test of writing there (root passes
    permission checks, /proc refuses everyone); it leaves nothing behind."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {str(out)!r} cannot be written: {e.strerror}") from None


def check_out_folder(out: Path, flag: str = "--out") -> None:
    """An output folder: an existing writable folder, or a path whose missing parents can be
    made (the writer makes them). Creates nothing, so a refused `--out` leaves nothing."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {str(out)!r} is a file; give a folder")
    base = _nearest(out)
    if not base.is_dir():
        raise ConfigError(f"{flag} {str(out)!r} cannot be made: {str(base)!r} is a file")
    _probe(base, flag, out)


def check_out_file(out: Path, flag: str = "--out", overwrite: bool = True) -> None:
    """An output file: a path in an existing writable folder, not a folder itself; an
    existing file is replaced only if `overwrite` (commands that write another run's or
    model's file ask for `--overwrite`). Creates nothing."""
    if out.is_dir():
        raise ConfigError(f"{flag} {str(out)!r} is a folder; give a file path")
    if out.exists() and not overwrite:
        raise ConfigError(f"{flag} {str(out)!r} already exists; add --overwrite to replace it")
    parent = out.parent
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        raise ConfigError(f"{flag} {str(out)!r}: its folder {str(parent)!r} {what}")
    _probe(parent, flag, out)


def umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish(path: Path) -> None:
    """Give a written file or folder the mode normal creation gives (0644/0755 under the
    usual umask): safetensors writes 0600 and mkdtemp 0700, which other users could not read
    (Hugging Face and every other tool write readable models)."""
    mask = umask()
    for item in (path, *(path.rglob("*") if path.is_dir() else ())):
        item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


@contextmanager
def atomic_file(out: Path) -> Iterator[Path]:
    """A temporary path beside `out` for the caller to write; when the block ends it gets the
    usual mode and replaces `out` in one rename, so `out` holds its old content or all of the
    new, never a part (Ctrl-C, a full disk); on failure the temporary file is removed."""
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        yield tmp
        publish(tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out` for the caller to fill; when the block ends it gets the
    usual modes and is renamed to `out` (absent or an empty folder), so nothing that looks
    finished is ever half written; on failure the temporary folder is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        publish(tmp)  # mkdtemp's 0700 and safetensors' 0600: others could not read it
        if out.exists():
            out.rmdir()  # empty (the caller checked)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
