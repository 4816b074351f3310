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
example's length, first target position, target count and prompt length (a run's sample
answers a validation example's prompt). Every file is read and checked before anything is
written, in this process (`--workers` is for text: the tokenizer's own threads encode each
batch of examples, and Alpaca's 52K examples take seconds).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plait.data.records import Record, parse_columns, read_records, unrendered
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
    """One tokenized example: its tokens and target mask (uint8), same length, and its
    prompt's length (the tokens before the first response, with --train-on-input too)."""

    tokens: np.ndarray
    mask: np.ndarray
    prompt: int


class Tokenized:
    """The tokenizer side of a format: encoder, specials and the template. `prepare` makes
    whole examples with it and `plait generate --template|--chat` and a run's sample make
    prompts with it (`prompt_ids`), through the same pieces and the same joining, so a
    prompt is tokenized at generation exactly as it was in training."""

    def __init__(
        self, fmt: str, spec: TokenizerSpec, chat_template: str | None = None,
        train_on_input: bool = False, flag: str = "--format chat",
    ) -> None:  # fmt: skip
        self.spec, self.encoder = spec, Encoder(spec)
        self.fmt, self.train_on_input = fmt, train_on_input
        file = Path(spec.path) if spec.path else None
        self.bos_text = self.encoder.token_text(spec.bos_id)
        self.template: ChatTemplate | None = None
        if fmt == "chat":
            bos = special_name(file, self.encoder.vocab(), "bos_token", ()) if file else None
            eos = self.encoder.token_text(spec.eos_id)
            folder = file.parent if file else None
            self.template = ChatTemplate.load(chat_template, folder, bos, eos, flag)

    @classmethod
    def of_job(cls, job: InstructJob) -> Tokenized:
        """The job's tokenizer (which must have an EOS) and template."""
        if job.fmt not in FORMATS[1:]:
            raise ConfigError(f"instruction --format is alpaca or chat; got {job.fmt!r}")
        if not job.tokenizer:
            raise ConfigError(
                f"--format {job.fmt} needs --tokenizer with an end-of-sequence token; the byte "
                "tokenizer has none (train one with `plait tokenizer train`)"
            )
        spec = resolve_tokenizer(job.tokenizer, f"--format {job.fmt} ends every response with it")
        return cls(job.fmt, spec, job.chat_template, job.train_on_input)

    def identity(self) -> dict[str, str]:
        return self.template.identity() if self.template else alpaca_identity()

    def pieces(self, record: Record) -> list[Turn]:
        """The example's text pieces, targets marked. A chat's first piece is the text up to
        its first assistant turn, rendered with the generation prompt (`ChatTemplate.turns`):
        `prompt_pieces` of those messages."""
        if self.template is not None:
            return self.template.turns(record.fields["messages"], f"{record.where}: ")
        f = record.fields
        return [*self.prompt_pieces(f), Turn(f["output"], True)]

    def prompt_pieces(self, fields: dict[str, Any]) -> list[Turn]:
        """What comes before a response: Stanford's prompt of `instruction` and `input`, or
        the chat template's rendering of `messages` with the generation prompt."""
        if self.template is not None:
            return [Turn(self.template.render(fields["messages"], True), False)]
        return [Turn(alpaca_prompt(fields["instruction"], fields.get("input")), False)]

    def prompt_ids(self, fields: dict[str, Any]) -> np.ndarray:
        """The prompt's tokens as `prepare` builds an example's (BOS first where the
        tokenizer has one, the text tokenized without special tokens): what a model trained
        on these examples answers."""
        pieces = self.prompt_pieces(fields)
        ids = self.encoder.encode_docs([p.text for p in pieces])
        return self._concat(pieces, ids)[0]

    def encode(self, records: list[Record], pieces: list[list[Turn]]) -> list[Example]:
        """The examples' tokens and masks, the pieces of all of them in one batch call."""
        flat = self.encoder.encode_docs([p.text for ps in pieces for p in ps])
        out, at = [], 0
        for record, ps in zip(records, pieces, strict=True):
            out.append(self._join(record, ps, flat[at : at + len(ps)]))
            at += len(ps)
        return out

    def _concat(self, pieces: list[Turn], ids: list[np.ndarray]) -> tuple[np.ndarray, ...]:
        """The pieces' tokens joined, BOS first where the tokenizer puts one (and the text
        does not start with it), with their target mask and the first target piece's start
        (the prompt's length; the whole length when no piece is a target)."""
        dtype = self.spec.dtype
        parts, masks = [], []
        starts_with_bos = self.bos_text is not None and pieces[0].text.startswith(self.bos_text)
        if self.spec.bos_id is not None and not starts_with_bos:
            parts.append(np.array([self.spec.bos_id], dtype))
            masks.append(np.zeros(1, np.uint8))
        prompt = None
        for piece, tokens in zip(pieces, ids, strict=True):
            if piece.target and prompt is None:
                prompt = sum(len(p) for p in parts)
            parts.append(tokens)
            masks.append(np.full(len(tokens), piece.target or self.train_on_input, np.uint8))
        tokens, mask = np.concatenate(parts).astype(dtype), np.concatenate(masks)
        return tokens, mask, len(tokens) if prompt is None else prompt

    def _join(self, record: Record, pieces: list[Turn], ids: list[np.ndarray]) -> Example:
        tokens, mask, prompt = self._concat(pieces, ids)
        if self.fmt == "alpaca":  # the response ends with EOS, as Stanford's train.py
            tokens = np.append(tokens, self.spec.eos_id).astype(self.spec.dtype)
            mask = np.append(mask, np.uint8(1))
        mask[0] = 0  # the first token is never predicted
        if not mask.any():
            raise ConfigError(f"{record.where} has no target tokens (its responses are empty)")
        return Example(tokens, mask, prompt)


def refuse_text_flags(columns: str | None, chat_template: str | None, train_on_input: bool) -> None:
    """The instruction-only flags make no sense with `--format text` (prepare and eval)."""
    for flag, given in (("--columns", columns), ("--chat-template", chat_template),
                        ("--train-on-input", train_on_input)):  # fmt: skip
        if given:
            raise ConfigError(f"{flag} is for --format alpaca or chat, not text")


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
    tok = Tokenized.of_job(job)
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
    template = tok.template
    dropped = unrendered(records, lambda m: template.render(m, False)) if template else {}
    partial = job.out.with_name(job.out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tokens = ShardWriter(partial, tok.spec.dtype, job.shard_tokens)
    masks = ShardWriter(partial, np.dtype(np.uint8), job.shard_tokens, prefix="mask")
    lengths, first, targets, prompts = [], [], [], []
    try:
        for i in range(0, len(records), CHUNK):
            for ex in tok.encode(records[i : i + CHUNK], pieces[i : i + CHUNK]):
                tokens.write(ex.tokens)
                masks.write(ex.mask)
                lengths.append(len(ex.tokens))
                first.append(int(np.argmax(ex.mask)))
                targets.append(int(ex.mask.sum()))
                prompts.append(ex.prompt)
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
            "prompts": prompts,
            "unrendered": dict(sorted(dropped.items())),  # role -> messages the template drops
        },
    }
    sources = [{"path": str(f), "bytes": f.stat().st_size} for f in files]
    index = write_index(partial, tok.spec, tokens.counts, sources, len(lengths), extra, True)
    if job.out.exists():
        shutil.rmtree(job.out)
    partial.rename(job.out)
    return index
