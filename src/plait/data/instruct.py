"""`plait data prepare --format alpaca|chat`: instruction examples in, shards with targets out.

Each example is tokenized once, as the references tokenize it (docs/finetuning.md, "Where
targets begin and end"):
- Alpaca, as Stanford's train.py: the text prompt + output + the EOS token's text, tokenized
  with the tokenizer's special tokens (its BOS where it adds one); the prompt tokenized the
  same way alone gives the boundary: its token count is where the targets start.
- Chat, as `apply_chat_template(tokenize=True)`: the rendered conversation tokenized without
  special tokens (the template writes its own); the targets are the tokens whose characters
  overlap the template's target spans (templates.py), as transformers'
  `return_assistant_tokens_mask` marks them. A token that spans a boundary is a target.

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
from plait.data.table_records import instruction_files
from plait.data.templates import ChatTemplate, alpaca_identity, alpaca_prompt
from plait.data.tokenizer import (
    Encoder,
    TokenizerSpec,
    resolve_tokenizer,
    template_specials,
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
    prompts with it (`prompt_ids`), tokenized as the references tokenize them: Stanford's
    `tokenizer(prompt)`, transformers' `apply_chat_template(add_generation_prompt=True)`."""

    def __init__(
        self, fmt: str, spec: TokenizerSpec, chat_template: str | None = None,
        train_on_input: bool = False, flag: str = "--format chat",
    ) -> None:  # fmt: skip
        self.spec, self.encoder = spec, Encoder(spec)
        self.fmt, self.train_on_input = fmt, train_on_input
        file = Path(spec.path) if spec.path else None
        self.eos_text = self.encoder.token_text(spec.eos_id)
        self.template: ChatTemplate | None = None
        if fmt == "chat":
            specials = template_specials(file, self.eos_text) if file else {}
            ends = self.encoder.control_tokens()
            folder = file.parent if file else None
            self.template = ChatTemplate.load(chat_template, folder, specials, ends, flag)

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

    def texts(self, record: Record) -> Texts:
        """What gets tokenized for one example, every template problem raised here."""
        f = record.fields
        if self.template is not None:
            text, spans = self.template.spans(f["messages"], f"{record.where}: ")
            return Texts(text, spans)
        prompt = alpaca_prompt(f["instruction"], f.get("input"))
        return Texts(prompt + f["output"] + self.eos_text, [], prompt)

    def prompt_ids(self, fields: dict[str, Any]) -> np.ndarray:
        """A prompt's tokens as the references make them at generation: Stanford's template
        tokenized with the tokenizer's special tokens (its BOS), or the conversation rendered
        with the generation prompt and tokenized once without them (the template writes its
        own), as `apply_chat_template(add_generation_prompt=True, tokenize=True)`."""
        if self.template is not None:
            text, special = self.template.render(fields["messages"], True), False
        else:
            text, special = alpaca_prompt(fields["instruction"], fields.get("input")), True
        ids = self.encoder.encodings([text], special)[0].ids
        return np.asarray(ids, dtype=self.spec.dtype)

    def encode(self, records: list[Record], texts: list[Texts]) -> list[Example]:
        """The examples' tokens and masks, tokenized in batch calls."""
        chat = self.template is not None
        full = self.encoder.encodings([t.text for t in texts], not chat)
        prompts = [] if chat else self.encoder.encodings([t.prompt for t in texts], True)
        out = []
        for i, (record, t, enc) in enumerate(zip(records, texts, full, strict=True)):
            ids = np.asarray(enc.ids, dtype=self.spec.dtype)
            if chat:
                mask = target_mask(enc.offsets, t.spans)
                prompt = int(np.argmax(mask)) if mask.any() else len(ids)
            else:
                prompt = self._alpaca_prompt(record, ids, len(prompts[i].ids))
                mask = np.zeros(len(ids), np.uint8)
                mask[prompt:] = 1
            out.append(self._finish(record, ids, mask, prompt))
        return out

    def _alpaca_prompt(self, record: Record, ids: np.ndarray, prompt: int) -> int:
        """Stanford's boundary: the prompt's own token count; the EOS must end the text."""
        if self.spec.eos_id not in ids[prompt:].tolist():
            raise ConfigError(
                f"{record.where}: tokenizer {self.spec.name!r} does not read its EOS "
                f"{self.eos_text!r} in text as one token (Stanford's recipe appends it as text)"
            )
        return prompt

    def _finish(self, record: Record, ids: np.ndarray, mask: np.ndarray, prompt: int) -> Example:
        if self.train_on_input:
            mask[:] = 1
        mask[0] = 0  # the first token is never predicted
        if not mask.any():
            raise ConfigError(f"{record.where} has no target tokens (its responses are empty)")
        return Example(ids, mask, prompt)


@dataclass(frozen=True)
class Texts:
    """One example's text to tokenize: its target character spans (chat), or Alpaca's
    prompt (whose token count marks where the targets start, as in Stanford's train.py)."""

    text: str
    spans: list[tuple[int, int]]
    prompt: str = ""


def target_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for every token whose characters overlap a target span (transformers' rule for
    `return_assistant_tokens_mask`): a token spanning a span's edge is a target."""
    mask = np.zeros(len(offsets), np.uint8)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask


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
    files = instruction_files(job.data)  # tables and `datasets` folders too
    return tok, [read_records(f, job.fmt, columns) for f in files], files


def prepare_examples(job: InstructJob) -> dict[str, Any]:
    """Tokenize the examples into `job.out` (through `OUT.partial`); returns the index."""
    tok, per_file, files = check_instruct(job)
    records = [r for rs in per_file for r in rs]
    if not records:
        raise ConfigError(f"data path {job.data!r} holds no examples")
    texts = [tok.texts(r) for r in records]  # every template problem before any writing
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
            for ex in tok.encode(records[i : i + CHUNK], texts[i : i + CHUNK]):
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
