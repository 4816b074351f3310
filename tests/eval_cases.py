"""What the `plait eval` tests share (no tests here): tiny Llama and GPT-2 folders with the
instruction tests' BPE beside their weights (vocabulary 400, <s>=0, </s>=1), Alpaca examples
of different lengths, and `plait eval ... --json` run in this process."""

from __future__ import annotations

import json
from pathlib import Path

from hf_models import gpt2_config, llama_config, save
from instruct_data import LLAMA_TEMPLATE, ROWS, tokenizer_folder
from plait.cli import main

SEQ = 256  # the Alpaca preamble alone is ~60 tokens of this small BPE
MORE = [
    {"instruction": "Write about foxes.", "input": "",
     "output": "The quick brown fox jumps over the lazy dog. " * 3},
    {"instruction": "Return the sum.", "input": "def add(a, b):", "output": "return a + b"},
]  # fmt: skip
EXAMPLES = ROWS + MORE  # 5 examples, 70 to 110 tokens: two or three share a row of 256


def family(kind: str):
    """A Llama (grouped-query attention, RoPE) or GPT-2 config the BPE's ids fit."""
    ids = dict(bos_token_id=0, eos_token_id=1)  # the BPE's <s> and </s>
    if kind == "llama":
        return llama_config(vocab=400, max_position_embeddings=SEQ, **ids)
    return gpt2_config(vocab=400, n_positions=SEQ, **ids)


def model_folder(folder: Path, kind: str) -> Path:
    """A model folder of `kind` with the tokenizer (and a chat template) beside its weights."""
    save(family(kind), folder)
    return tokenizer_folder(folder, LLAMA_TEMPLATE)


def evaluate(argv: list[str], capsys) -> dict:
    """`plait eval ARGV --json` in this process (world 1 runs in the launcher's process)."""
    code = main(["eval", *argv, "--json", "--device", "cpu"])  # micro-batch: the rows
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    return {**json.loads(out.out), "stderr": out.err}
