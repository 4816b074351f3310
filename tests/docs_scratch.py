"""Folders in which the docs' command lines run as written (no tests here).

The docs' lines name files that their earlier lines make (a tokenizer, prepared shards), that
the reader brings (`my_corpus/`), or that sit in the checkout (`configs/`). Each line runs in
a folder of its own holding all of them: made once per module (a stand-in corpus, a
tokenizer trained on it and shards prepared with it, tiny Hugging Face folders with random
weights, a PEFT adapter for one of them) and linked in, except what the line itself writes;
the configs are copied (a `plan --out configs/...` line writes there). `runs/default` holds
a finished run, as after `make train`: a `train` line without its own `--out` is refused
there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from hf_models import gpt2_config, llama3_config, llama_config, save
from plait.data.instruct import InstructJob, prepare_examples
from plait.data.prepare import PrepareJob, prepare
from plait.data.sources import iter_texts, source_files
from plait.data.tokenizer import resolve_tokenizer, train_bpe
from plait.models.declare import is_adapter
from plait.models.hf.load import load_config
from plait.models.hf.peft import save_adapter
from plait.models.init import seeded
from plait.models.transformer import Transformer
from plait.outdir import RUN_FILES

CORPUS_TEXT = "plait reads text. " * 20_000  # the stand-in for the reader's `my_corpus/`
LINKED = ("my_corpus", "tok.json", "shards", "hf", "adapters")
EXAMPLES = "runs/finetune/sft"  # the instruction recipe's examples (docs/finetuning.md)
LLAMA32 = "runs/llama32/sft"  # docs/models.md's Llama 3.2 recipe: the same stand-in examples


def shared_artifacts(folder: Path, root: Path) -> Path:
    """Make, in `folder`, what the docs' lines read; returns `folder`."""
    corpus = folder / "my_corpus"
    corpus.mkdir()
    (corpus / "corpus.txt").write_text(CORPUS_TEXT)
    train_bpe(iter_texts(source_files(str(corpus)), "text"), 320, folder / "tok.json", None, False)
    prepare(PrepareJob(str(corpus), folder / "shards", str(folder / "tok.json")))
    save(llama_config(max_position_embeddings=1024), folder / "hf" / "tiny-llama")
    save(gpt2_config(n_positions=1024), folder / "hf" / "gpt2-small")  # its context
    _adapter(folder / "hf" / "tiny-llama", folder / "adapters" / "lora")
    vocab = resolve_tokenizer(folder / "tok.json").vocab_size  # hf/llama32 speaks its ids
    save(llama3_config(vocab, max_position_embeddings=1024), folder / "hf" / "llama32")
    shutil.copyfile(folder / "tok.json", folder / "hf" / "llama32" / "tokenizer.json")
    shutil.copytree(root / "configs", folder / "configs")
    _examples(folder)
    return folder


def _adapter(base: Path, out: Path) -> None:
    """A PEFT adapter folder for `base` (rank 8, PEFT's default targets, seeded values)."""
    cfg = load_config(base)
    cfg.lora_rank = 8
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Transformer(cfg).named_parameters()}
    value = seeded(cfg, 0)
    save_adapter(out, cfg, {n: value(n, s, None) for n, s in shapes.items() if is_adapter(n)},
                 str(base))  # fmt: skip


def _examples(folder: Path) -> None:
    """A stand-in for the recipe's examples folder: enough Alpaca records, prepared with the
    stand-in tokenizer, for a global batch of packed 512-token rows and a validation."""
    records = [
        {"instruction": f"Repeat the word {i}.", "input": "", "output": "text " * (i % 60 + 20)}
        for i in range(600)
    ]
    source = folder / "records.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = folder / "examples"
    prepare_examples(InstructJob(str(source), out, "alpaca", str(folder / "tok.json")))


def scratch_folder(folder: Path, artifacts: Path, argv: list[str]) -> Path:
    """`folder` made a place to run the line `argv`: the shared artifacts it may read
    linked (not the one it writes, its `--out`), the configs copied, a run in
    `runs/default`."""
    out = argv[argv.index("--out") + 1].rstrip("/") if "--out" in argv else None
    for name in LINKED:
        if name != out:
            (folder / name).symlink_to(artifacts / name)
    shutil.copytree(artifacts / "configs", folder / "configs")
    _previous_run(folder / "runs" / "default")
    for examples in (EXAMPLES, LLAMA32):
        if out != examples:
            (folder / examples).parent.mkdir(parents=True)
            (folder / examples).symlink_to(artifacts / "examples")
    return folder


def _previous_run(out: Path) -> None:
    """What a finished run leaves in `out` (the files `plait train` refuses to mix with)."""
    out.mkdir(parents=True)
    for name in RUN_FILES:
        (out / name).write_text("{}\n")
