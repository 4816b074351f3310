"""The synthetic Alpaca-like set of `bench_sft.py` and the timing of `plait data prepare` on it.

Why synthetic: the benchmark must run offline and its length distribution must be known and
stated. Why a BPE trained here (`plait tokenizer train` on the set's own text) rather than the
standard-library instruction set (`plait data instructions`): that set's lengths are those of
documented stdlib functions (long responses, a tail past 512 tokens), not Alpaca's, and its
size is fixed; the synthetic set is sized by `--examples` and shaped like Alpaca.

Lengths, in words (a word is a few BPE tokens): instruction ~ lognormal(median 12, sigma 0.5),
at least 3; an input in 40% of records (Alpaca: ~40%), ~ lognormal(median 12, sigma 0.8);
output ~ lognormal(median 40, sigma 0.9), cut to 1..400 words. Alpaca's responses are mostly
short with a tail of a few hundred tokens; its prompts are the ~30-token Stanford preamble plus
a short instruction. Words are drawn Zipf-like from a seeded vocabulary of random
pseudo-words, so BPE has frequent pieces to merge. The token lengths measured after `prepare`
are printed with every run (`length_summary`).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from plait.data.shards import read_index
from plait.data.templates import alpaca_prompt

PLAIT = [sys.executable, "-m", "plait.cli"]


def _words(rng: random.Random, size: int) -> list[str]:
    """`size` distinct pseudo-words of 2 to 9 lowercase letters."""
    seen: set[str] = set()
    while len(seen) < size:
        seen.add("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))))
    return sorted(seen)


def _count(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def alpaca_records(seed: int, n: int, vocab: int = 5000) -> list[dict[str, str]]:
    """`n` Alpaca records (instruction, input, output) of random words (module docstring)."""
    rng = random.Random(seed)
    words = _words(rng, vocab)
    cum = list(np.cumsum([1.0 / (r + 1) for r in range(vocab)]))  # Zipf-like frequencies

    def text(k: int, end: str) -> str:
        return " ".join(rng.choices(words, cum_weights=cum, k=k)).capitalize() + end

    out = []
    for _ in range(n):
        instruction = text(_count(rng, 12, 0.5, 3, 60), "?")
        has_input = rng.random() < 0.4
        given = text(_count(rng, 12, 0.8, 1, 200), ".") if has_input else ""
        output = text(_count(rng, 40, 0.9, 1, 400), ".")
        out.append({"instruction": instruction, "input": given, "output": output})
    return out


def write_set(root: Path, seed: int, n: int) -> tuple[Path, Path]:
    """The records as JSONL (the alpaca path's input) and the same text as one JSONL document
    per record, Stanford's prompt followed by the output (the text path's input)."""
    records = alpaca_records(seed, n)
    alpaca, texts = root / "alpaca.jsonl", root / "texts.jsonl"
    alpaca.write_text("".join(json.dumps(r) + "\n" for r in records))
    docs = (alpaca_prompt(r["instruction"], r["input"] or None) + r["output"] for r in records)
    texts.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return alpaca, texts


def plait(*argv: str) -> float:
    """Wall seconds of one `plait` command (process start and imports included)."""
    began = time.perf_counter()
    subprocess.run([*PLAIT, *argv], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def train_tokenizer(root: Path, texts: Path, vocab_size: int) -> Path:
    tok = root / "tok.json"
    plait("tokenizer", "train", "--data", str(texts), "--text-key", "text",
          "--vocab-size", str(vocab_size), "--out", str(tok), "--no-progress")  # fmt: skip
    return tok


def prepare_args(kind: str, data: Path, tok: Path, out: Path) -> list[str]:
    """`plait data prepare` on the alpaca records or on the same text as documents."""
    common = ["data", "prepare", "--data", str(data), "--tokenizer", str(tok), "--out",
              str(out), "--overwrite", "--no-progress", "--workers", "1"]  # fmt: skip
    if kind == "alpaca":
        return [*common, "--format", "alpaca"]
    return [*common, "--text-key", "text"]


def prepare_throughput(
    root: Path, alpaca: Path, texts: Path, tok: Path, repeats: int
) -> tuple[dict[str, Any], Path]:
    """Both prepare paths, alternating, `repeats` times: median seconds, tokens/s, examples/s
    (records/s for text) and MB/s of input. Returns the figures and the examples folder."""
    inputs = {"alpaca": alpaca, "text": texts}
    seconds: dict[str, list[float]] = {k: [] for k in inputs}
    for r in range(repeats):
        for kind in inputs if r % 2 == 0 else reversed(list(inputs)):
            seconds[kind].append(plait(*prepare_args(kind, inputs[kind], tok, root / kind)))
    records = sum(1 for _ in alpaca.open())
    out: dict[str, Any] = {}
    for kind, data in inputs.items():
        index = read_index(root / kind)
        tokens = int(index["tokens"])
        s = statistics.median(seconds[kind])
        out[kind] = {"seconds": seconds[kind], "median_s": s, "tokens": tokens,
                     "tokens/s": tokens / s, "examples/s": records / s,
                     "MB/s": data.stat().st_size / 1e6 / s}  # fmt: skip
        if kind == "alpaca":
            meta = index["examples"]
            out[kind]["target_tokens"] = int(np.sum(meta["targets"]))
    return out, root / "alpaca"


def length_summary(folder: Path) -> dict[str, dict[str, int]]:
    """Percentiles of the prepared examples' prompt tokens (before the first target),
    response tokens (from it, EOS included) and whole lengths: the distribution trained on."""
    meta = read_index(folder)["examples"]
    lengths = np.asarray(meta["lengths"])
    prompt = np.asarray(meta["first_target"])
    parts = {"prompt": prompt, "response": lengths - prompt, "example": lengths}
    qs = {"p10": 10, "p50": 50, "p90": 90, "p99": 99}
    return {
        k: {**{q: int(np.percentile(v, p)) for q, p in qs.items()}, "max": int(v.max()),
            "mean": round(float(v.mean()), 1)}
        for k, v in parts.items()
    }  # fmt: skip
