"""`plait data prepare --format alpaca|chat`: instruction examples in, shards with targets out.

Each example is a list of pieces (Alpaca: the templated prompt, then `output`; chat: the
rendered text between assistant turns, then each turn), every piece tokenized on its own
with no special tokens added, then joined: BOS first where the tokenizer puts one (and the
rendered text does not already start with it), and for Alpaca the EOS id after the response,
as Stanford's train.py appends it. Tokenizing the pieces apart makes the target boundary
exact: no BPE merge crosses from prompt into response. A chat template writes its own end
of turn (its `eos_token` or an end-of-turn token), so nothing is appended to chat turns.

The folder holds the token shards as today (`shard-*.bin`), a target mask cut the same way
(`mask-*.bin`, uint8: 1 where the token is a target; never the first token, which nothing
predicts) and `examples.bin` (int64 offsets, examples + 1 of them); `index.json` records
kind "examples" and, under "examples", the format, the template (name and SHA-256), every
example's length, first target position and target count. Every file is read and checked
before anything is written, in this process (`--workers` is for text: the tokenizer's own
threads encode each batch of examples, and Alpaca's 52K examples take seconds).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plait.data.records import Record, parse_columns, read_records
from plait.data.shards import ShardWriter, write_index
from plait.data.sources import source_files
from plait.data.templates import ChatTemplate, Turn, alpaca_identity, alpaca_prompt
from plait.data.tokenizer import (
    Encoder,
    TokenizerSpec,
    resolve_tokenizer,
    special_name,
)
from plait.errors import ConfigError
from plait.outdir import check_out_folder

FORMATS = ("text", "alpaca", "chat")
OFFSETS = "examples.bin"
CHUNK = 4096  # examples tokenized per encode_batch call: bounds the lists held at once


@dataclass(frozen=True)
class InstructJob:
    """One `data prepare --format alpaca|chat` request."""

    data: str | None
    out: Path
    fmt: str
    tokenizer: str | None
    columns: str | None = None
    chat_template: str | None = None
    train_on_input: bool = False
    shard_tokens: int = 1 << 27
    overwrite: bool = False


@dataclass(frozen=True)
class Example:
    """One tokenized example: its tokens and target mask (uint8), same length."""

    tokens: np.ndarray
    mask: np.ndarray


class Tokenized:
    """The tokenizer side of a job: encoder, specials and the template of the format."""

    def __init__(self, job: InstructJob) -> None:
        if job.fmt not in FORMATS[1:]:
            raise ConfigError(f"instruction --format is alpaca or chat; got {job.fmt!r}")
        if not job.tokenizer:
            raise ConfigError(
                f"--format {job.fmt} needs --tokenizer with an end-of-sequence token; the byte "
                "tokenizer has none (train one with `plait tokenizer train`)"
            )
        self.spec: TokenizerSpec = resolve_tokenizer(
            job.tokenizer, f"--format {job.fmt} ends every response with it"
        )
        self.encoder = Encoder(self.spec)
        self.fmt, self.train_on_input = job.fmt, job.train_on_input
        file = Path(self.spec.path)
        vocab = self.encoder.vocab()
        self.bos_text = self.encoder.token_text(self.spec.bos_id)
        self.template: ChatTemplate | None = None
        if job.fmt == "chat":
            bos = special_name(file, vocab, "bos_token", ())
            eos = self.encoder.token_text(self.spec.eos_id)
            self.template = ChatTemplate.load(job.chat_template, file.parent, bos, eos)

    def identity(self) -> dict[str, str]:
        return self.template.identity() if self.template else alpaca_identity()

    def pieces(self, record: Record) -> list[Turn]:
        """The example's text pieces, targets marked."""
        if self.template is not None:
            return self.template.turns(record.fields["messages"], f"{record.where}: ")
        f = record.fields
        return [Turn(alpaca_prompt(f["instruction"], f["input"]), False),
                Turn(f["output"], True)]  # fmt: skip

    def encode(self, records: list[Record], pieces: list[list[Turn]]) -> list[Example]:
        """The examples' tokens and masks, the pieces of all of them in one batch call."""
        flat = self.encoder.encode_docs([p.text for ps in pieces for p in ps])
        out, at = [], 0
        for record, ps in zip(records, pieces, strict=True):
            out.append(self._join(record, ps, flat[at : at + len(ps)]))
            at += len(ps)
        return out

    def _join(self, record: Record, pieces: list[Turn], ids: list[np.ndarray]) -> Example:
        dtype = self.spec.dtype
        parts, masks = [], []
        starts_with_bos = self.bos_text is not None and pieces[0].text.startswith(self.bos_text)
        if self.spec.bos_id is not None and not starts_with_bos:
            parts.append(np.array([self.spec.bos_id], dtype))
            masks.append(np.zeros(1, np.uint8))
        for piece, tokens in zip(pieces, ids, strict=True):
            parts.append(tokens)
            masks.append(np.full(len(tokens), piece.target or self.train_on_input, np.uint8))
        if self.fmt == "alpaca":
            parts.append(np.array([self.spec.eos_id], dtype))
            masks.append(np.ones(1, np.uint8))
        tokens, mask = np.concatenate(parts).astype(dtype), np.concatenate(masks)
        mask[0] = 0  # the first token is never predicted
        if not mask.any():
            raise ConfigError(f"{record.where} has no target tokens (its responses are empty)")
        return Example(tokens, mask)


def check_instruct(job: InstructJob) -> tuple[Tokenized, list[list[Record]], list[Path]]:
    """Every check, in this process, before anything is written: the output folder, the
    tokenizer and template, and every row of every file."""
    if job.shard_tokens < 1:
        raise ConfigError(f"--shard-tokens must be at least 1, got {job.shard_tokens}")
    check_out_folder(job.out)
    if job.out.exists() and not job.overwrite:
        raise ConfigError(f"output folder {str(job.out)!r} exists; add --overwrite to replace it")
    if job.data is None:
        raise ConfigError(f"--format {job.fmt} needs --data FILE (a JSON array or JSONL)")
    tok = Tokenized(job)
    columns = parse_columns(job.columns, job.fmt)
    files = source_files(job.data)
    return tok, [read_records(f, job.fmt, columns) for f in files], files


def prepare_examples(job: InstructJob) -> dict[str, Any]:
    """Tokenize the examples into `job.out` (through `OUT.partial`); returns the index."""
    tok, per_file, files = check_instruct(job)
    records = [r for rs in per_file for r in rs]
    if not records:
        raise ConfigError(f"data path {job.data!r} holds no examples")
    pieces = [tok.pieces(r) for r in records]  # every template problem before any writing
    partial = job.out.with_name(job.out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tokens = ShardWriter(partial, tok.spec.dtype, job.shard_tokens)
    masks = ShardWriter(partial, np.dtype(np.uint8), job.shard_tokens, prefix="mask")
    lengths, first, targets = [], [], []
    try:
        for i in range(0, len(records), CHUNK):
            for ex in tok.encode(records[i : i + CHUNK], pieces[i : i + CHUNK]):
                tokens.write(ex.tokens)
                masks.write(ex.mask)
                lengths.append(len(ex.tokens))
                first.append(int(np.argmax(ex.mask)))
                targets.append(int(ex.mask.sum()))
    except BaseException:
        tokens.close()
        masks.close()
        shutil.rmtree(partial, ignore_errors=True)
        raise
    tokens.close()
    masks.close()
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype("<i8")
    offsets.tofile(partial / OFFSETS)
    extra = {
        "kind": "examples",
        "examples": {
            "format": job.fmt,
            "template": tok.identity(),
            "train_on_input": job.train_on_input,
            "bos_id": tok.spec.bos_id,
            "count": len(lengths),
            "target_tokens": int(sum(targets)),
            "offsets": OFFSETS,
            "lengths": lengths,
            "first_target": first,
            "targets": targets,
        },
    }
    sources = [{"path": str(f), "bytes": f.stat().st_size} for f in files]
    index = write_index(partial, tok.spec, tokens.counts, sources, len(lengths), extra, True)
    if job.out.exists():
        shutil.rmtree(job.out)
    partial.rename(job.out)
    return index
