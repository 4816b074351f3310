"""Tokenizers: the built-in byte tokenizer or a Hugging Face `tokenizers` byte-level BPE.

A tokenizer here is named by a path (`--tokenizer`): a `tokenizer.json` file or a local
Hugging Face tokenizer folder holding one; no path means the byte tokenizer (vocabulary 256,
nothing to ship). Its identity is the SHA-256 of the `tokenizer.json` bytes: the shard index
and the checkpoint record it, so tokens made by one tokenizer are never read with another.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plait.data.corpus import ByteTokenizer
from plait.errors import ConfigError
from plait.outdir import atomic_file, check_out_file
from plait.signals import pausing_after_first, stoppable

# The end-of-document token a trained tokenizer gets, and the names looked for in others.
EOS_TOKEN = "<|endoftext|>"
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")
_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>")
_DOCUMENTS = "documents need one between them"
BYTE_EOS = 10  # the byte tokenizer separates documents with "\n", as raw text does


@dataclass(frozen=True)
class TokenizerSpec:
    """What a run and the shard index need to know about a tokenizer, without loading it
    in every process: where it is, its vocabulary, its end-of-document id and identity."""

    path: str | None  # the tokenizer.json file; None: bytes
    vocab_size: int
    eos_id: int
    identity: str | None  # SHA-256 of tokenizer.json; None: the byte tokenizer
    bos_id: int | None = None  # the id put first when special tokens are added (a BOS)

    @property
    def name(self) -> str:
        return self.path or "bytes"

    @property
    def dtype(self) -> np.dtype:
        """The narrowest token dtype that holds every id: uint16 when it fits."""
        return np.dtype(np.uint16 if self.vocab_size <= 2**16 else np.uint32)


BYTES = TokenizerSpec(None, 256, BYTE_EOS, None)


def _json_file(path: Path) -> Path:
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"tokenizer {str(path)!r} does not exist (give a tokenizer.json file or a "
            "Hugging Face tokenizer folder holding one)"
        )
    return path


def _config(file: Path) -> dict:
    """The folder's tokenizer_config.json ({} when there is none)."""
    config = file.parent / "tokenizer_config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def special_name(file: Path, vocab: dict[str, int], key: str, usual: tuple[str, ...]):
    """The folder's tokenizer_config.json `key` (eos_token, bos_token) if it names a token
    of the vocabulary, else the first usual name the vocabulary has, else None."""
    name = _token_text(_config(file).get(key))
    if name is not None and name in vocab:
        return name
    return next((name for name in usual if name in vocab), None)


SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")  # fmt: skip


def template_specials(file: Path, eos: str | None) -> dict[str, str]:
    """The special-token names a chat template reads, as transformers passes them: those
    tokenizer_config.json sets; a bare tokenizer.json (no config) gets its EOS (and BOS)."""
    config = _config(file)
    if not config:
        tok = _load(file)
        vocab = tok.get_vocab(with_added_tokens=True)
        bos = next((name for name in _BOS_CANDIDATES if name in vocab), None)
        return {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    named = {key: _token_text(config.get(key)) for key in SPECIAL_KEYS}
    return {key: value for key, value in named.items() if value is not None}


def resolve_tokenizer(path: str | Path | None, needs_eos: str = _DOCUMENTS) -> TokenizerSpec:
    """The spec of the tokenizer at `path` (None: bytes); ConfigError if it cannot load or
    has no end-of-sequence token (`needs_eos` says what for)."""
    if path is None or str(path) == "":
        return BYTES
    file = _json_file(Path(path))
    raw = file.read_bytes()
    tok = _load(file)
    vocab = tok.get_vocab(with_added_tokens=True)
    eos = special_name(file, vocab, "eos_token", _EOS_CANDIDATES)
    if eos is None:
        raise ConfigError(
            f"tokenizer {str(file)!r} has no end-of-sequence token (none of "
            f"{', '.join(_EOS_CANDIDATES)}); {needs_eos}"
        )
    size = tok.get_vocab_size(with_added_tokens=True)
    digest = hashlib.sha256(raw).hexdigest()
    return TokenizerSpec(str(file), size, vocab[eos], digest, _first_special(tok))


def _first_special(tok) -> int | None:
    """The id the tokenizer puts first when it adds special tokens (its BOS), if any: what
    tokenizer.json's post-processor adds. transformers 5 does the same (it ignores
    tokenizer_config.json's add_bos_token where a tokenizer.json exists)."""
    plain = tok.encode("a", add_special_tokens=False).ids
    ids = tok.encode("a", add_special_tokens=True).ids
    return ids[0] if ids and ids[: len(plain)] != plain else None


def _load(file: Path):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise ConfigError(f"tokenizer {str(file)!r} cannot be loaded: {e}") from None


class Encoder:
    """Turns documents (bytes of text files, str of records) into one token array with the
    end-of-document id between them; made once per worker process."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self._tok = _load(Path(spec.path)) if spec.path else None

    def encode_docs(self, docs: Sequence[bytes | str]) -> list[np.ndarray]:
        """Each document's tokens, in one `encode_batch` call (no special tokens added:
        only the end-of-document id separates documents, placed by `join`)."""
        if self._tok is None:
            return [np.frombuffer(_as_bytes(d), dtype=np.uint8).astype(self.spec.dtype)
                    for d in docs]  # fmt: skip
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
        encoded = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=self.spec.dtype) for e in encoded]

    def encodings(self, texts: Sequence[str], add_special_tokens: bool) -> list:
        """Each text's `tokenizers.Encoding` (ids and character offsets), in one call."""
        return self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)

    def vocab(self) -> dict[str, int]:
        """Every token's id by its string, added tokens included (bytes: none)."""
        return self._tok.get_vocab(with_added_tokens=True) if self._tok else {}

    def control_tokens(self) -> tuple[str, ...]:
        """The strings of the tokenizer's added tokens, special or not, but whitespace (what
        may end a chat turn: `<|im_end|>` is added either way; Gemma's "\n" is text)."""
        if self._tok is None:
            return ()
        added = self._tok.get_added_tokens_decoder().values()
        return tuple(t.content for t in added if t.content.strip())

    def token_text(self, token: int | None) -> str | None:
        """The string of a special token (a chat template writes it), None for none."""
        if token is None or self._tok is None:
            return None
        return self._tok.id_to_token(token)

    def join(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        """The documents' tokens with the end-of-document id between them."""
        eos = np.array([self.spec.eos_id], dtype=self.spec.dtype)
        joined: list[np.ndarray] = []
        for i, part in enumerate(parts):
            if i:
                joined.append(eos)
            joined.append(part)
        return np.concatenate(joined) if joined else np.empty(0, self.spec.dtype)

    def encode(self, docs: Sequence[bytes | str]) -> np.ndarray:
        """The documents' tokens joined by end-of-document ids, in the spec's dtype."""
        return self.join(self.encode_docs(docs))

    def encode_text(self, text: bytes) -> np.ndarray:
        """One stream of raw text (the in-memory `--data` path) as tokens."""
        return self.encode([text])


def _as_bytes(doc: bytes | str) -> bytes:
    return doc if isinstance(doc, bytes) else doc.encode("utf-8")


def train_bpe(
    texts: Iterable[str], vocab_size: int, out: Path, length: int | None, progress: bool
) -> TokenizerSpec:
    """Train a byte-level BPE tokenizer (GPT-2's scheme) on `texts` and save it to `out`.

    Byte-level means every string is encodable (the 256 bytes are the base alphabet), so
    the vocabulary must hold them plus the end-of-document token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    floor = 256 + 1
    if vocab_size < floor:
        raise ConfigError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE: it needs the 256 "
            f"bytes and {EOS_TOKEN}, at least {floor}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    check_out_file(out)  # before the training, which can take minutes
    texts = pausing_after_first(texts, "tokenizer", "plait")  # a test signals in training
    with stoppable(texts) as texts:  # Ctrl-C while the tokenizer reads: at the next text
        tok.train_from_iterator(texts, trainer, length=length)
    with atomic_file(out) as tmp:
        tok.save(str(tmp))
    return resolve_tokenizer(out)


class TextTokenizer:
    """A trained tokenizer with the byte tokenizer's text interface (`encode` a string to
    ids, `decode` ids to a string), for generation and the summary's sample."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self._tok = _load(Path(spec.path))
        self.vocab_size = spec.vocab_size

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)])


def text_tokenizer(spec: TokenizerSpec) -> TextTokenizer | ByteTokenizer:
    """What turns text into a run's ids and back: bytes, or the run's trained tokenizer."""
    return TextTokenizer(spec) if spec.path else ByteTokenizer()
