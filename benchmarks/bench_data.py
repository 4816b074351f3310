"""`plait data prepare` throughput and memory, next to `tokenizers`' own batch encoding.

    .venv/bin/python benchmarks/bench_data.py --out benchmarks/results/data_prepare.json

1. Trains a byte-level BPE (`--vocab-size`) on the first `--train-mb` MB of the standard
   library (the default corpus) with `plait tokenizer train`.
2. Runs `plait data prepare` on the whole standard library with 1 and 2 workers, alternating,
   `--repeats` times each: MB/s and tokens/s of the command (process start included).
3. Encodes the same files in one process with `Tokenizer.encode_batch` (tokenizers' own
   thread pool, texts already in memory): the library's speed without plait around it.
4. Peak RSS of `plait data prepare` (the largest process: the main one or a worker) on the
   standard library and on `--copies` copies of it, to show memory does not grow with the
   corpus; the copies are symlinks, so nothing large is written.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from plait.data import corpus_files

PLAIT = [sys.executable, "-m", "plait.cli"]


def _prepare(tok: Path, out: Path, workers: int) -> list[str]:
    """`plait data prepare` arguments (the default corpus unless --data is added)."""
    return ["data", "prepare", "--tokenizer", str(tok), "--out", str(out),
            "--workers", str(workers), "--overwrite", "--no-progress"]  # fmt: skip


def _run(argv: list[str]) -> float:
    began = time.perf_counter()
    subprocess.run([*PLAIT, *argv], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def _peak_rss_mib(argv: list[str]) -> float:
    """The largest resident set of the command's processes (ru_maxrss of reaped children)."""
    code = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
        "stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *PLAIT, *argv], check=True, capture_output=True, text=True
    )
    return int(out.stdout.split()[-1]) / 1024  # KiB on Linux


def _train_slice(root: Path, megabytes: float) -> Path:
    """The first `megabytes` of the stdlib as a folder of symlinks, for tokenizer training."""
    folder, total = root / "train_slice", 0
    folder.mkdir()
    for i, f in enumerate(corpus_files(None)):
        (folder / f"{i:05d}.py").symlink_to(f)
        total += f.stat().st_size
        if total >= megabytes * 1e6:
            break
    return folder


def _copies(root: Path, n: int) -> Path:
    folder = root / "copies"
    for c in range(n):
        sub = folder / f"copy{c}"
        sub.mkdir(parents=True)
        for i, f in enumerate(corpus_files(None)):
            (sub / f"{i:05d}.py").symlink_to(f)
    return folder


def _hf_batch(tok_file: Path, files: list[Path]) -> float:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    began = time.perf_counter()
    tok.encode_batch(texts)
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--train-mb", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    opts = ap.parse_args()
    files = corpus_files(None)
    megabytes = sum(f.stat().st_size for f in files) / 1e6
    root = Path(tempfile.mkdtemp(prefix="plait-bench-data-"))
    try:
        tok = root / "tok.json"
        _run(
            [
                "tokenizer",
                "train",
                "--data",
                str(_train_slice(root, opts.train_mb)),
                "--vocab-size",
                str(opts.vocab_size),
                "--out",
                str(tok),
                "--no-progress",
            ]
        )
        seconds: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(opts.repeats):
            for workers in (1, 2):
                argv = _prepare(tok, root / "s", workers)
                seconds[workers].append(_run(argv))
        tokens = json.loads((root / "s" / "index.json").read_text())["tokens"]
        hf = statistics.median(_hf_batch(tok, files) for _ in range(opts.repeats))
        big = _copies(root, opts.copies)
        rss = {}
        for name, data in (("stdlib", None), (f"stdlib x{opts.copies}", big)):
            argv = _prepare(tok, root / "m", 2)
            rss[name] = _peak_rss_mib([*argv, "--data", str(data)] if data else argv)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = {f"plait data prepare, {w} worker(s)": statistics.median(s) for w, s in seconds.items()}
    rows["tokenizers encode_batch, 1 process (threads: all cores)"] = hf
    result = {
        "machine": f"{os.cpu_count()} CPU cores",
        "corpus": f"standard library *.py, {len(files)} files, {megabytes:.1f} MB",
        "vocab_size": opts.vocab_size,
        "tokens": tokens,
        "throughput": {
            k: {
                "seconds": round(v, 2),
                "MB/s": round(megabytes / v, 2),
                "tokens/s": round(tokens / v),
            }
            for k, v in rows.items()
        },
        "peak_rss_mib": {k: round(v, 1) for k, v in rss.items()},
        "copies_mb": round(megabytes * opts.copies, 1),
        "self_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if opts.out:
        opts.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
