"""Tokenizer folders shaped as the model families ship them, trained here (nothing downloaded),
with the families' own chat templates (tests/chat_templates/), for the token tests against
transformers (no tests here).

Byte-level: Llama-3 (a Split regex then ByteLevel, a post-processor adding
<|begin_of_text|>, tokenizer_class PreTrainedTokenizerFast), Qwen2.5 (NFC, its Split regex,
ByteLevel, tokenizer_class Qwen2Tokenizer, no BOS), GPT-2 (ByteLevel with its own regex,
tokenizer_class GPT2Tokenizer; ChatML's tokens added, as fine-tuners add them).
SentencePiece-style (Llama-2, Mistral, Zephyr, TinyLlama): BPE with byte fallback (the 256
<0xNN> tokens are ordinary vocabulary, as in LLaMA's), a Prepend("▁") + Replace(" ", "▁")
normalizer, no pre-tokenizer, a Replace/ByteFallback/Fuse/Strip decoder, a TemplateProcessing
post-processor putting <s> first, tokenizer_class LlamaTokenizer (legacy, as Mistral and
Zephyr ship: transformers 5 rebuilds the pipeline from the class, and `legacy: false` would
change it; docs/finetuning.md says where).
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATES = Path(__file__).parent / "chat_templates"
CORPUS = [
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request. The quick brown fox jumps over the lazy dog. add and remove "
    "the numbers, hello there, how are you? I am fine. def add(a, b): return a + b "
    "You are a helpful assistant. Be brief. What is 2+2? It is 4. Instruction Response "
    "Input system user assistant tools cutting knowledge date today std::map a::b c::d",
    "one\n\ntwo\n\n\nthree\n\n\nfour\n\nfive\n",  # byte-level: merges of newlines
] * 4
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]  # fmt: skip
FAMILIES = (
    "llama2",
    "mistral",
    "zephyr",
    "llama3",
    "llama3.1",
    "llama3.2",
    "qwen2.5",
    "gpt2",
    "gemma",
)


def template(name: str) -> str:
    """A family's chat template as its tokenizer_config.json holds it."""
    return (TEMPLATES / f"{name}.jinja").read_text().rstrip("\n")


def _save(tok, folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return folder


def _byte_level(pre_tokenizer, specials: list[str], normalizer=None):
    """A byte-level BPE (vocabulary 600) with `specials` as added special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _split(regex: str):
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])  # fmt: skip


def llama3_folder(folder: Path, name: str = "llama3.1") -> Path:
    from tokenizers import processors

    tok = _byte_level(_split(LLAMA3_REGEX), LLAMA3_SPECIALS)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                      special_tokens=[(bos, tok.token_to_id(bos))]),
    ])  # fmt: skip
    config = {"bos_token": bos, "eos_token": "<|eot_id|>", "chat_template": template(name),
              "clean_up_tokenization_spaces": True, "model_max_length": 131072,
              "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    return _save(tok, folder, config)


def qwen_folder(folder: Path, name: str = "qwen2.5") -> Path:
    from tokenizers import normalizers, processors

    tok = _byte_level(_split(QWEN_REGEX), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                      normalizers.NFC())  # fmt: skip
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None, "add_prefix_space": False, "errors": "replace",
              "split_special_tokens": False, "chat_template": template(name),
              "model_max_length": 131072, "tokenizer_class": "Qwen2Tokenizer"}  # fmt: skip
    return _save(tok, folder, config)


def gpt2_folder(folder: Path, name: str = "chatml") -> Path:
    from tokenizers import pre_tokenizers, processors

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = _byte_level(pre_tokenizers.ByteLevel(add_prefix_space=False), specials)
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    eot = "<|endoftext|>"
    config = {"bos_token": eot, "eos_token": eot, "unk_token": eot, "add_prefix_space": False,
              "chat_template": template(name), "model_max_length": 1024,
              "tokenizer_class": "GPT2Tokenizer"}  # fmt: skip
    return _save(tok, folder, config)


def sentencepiece_tokenizer():
    """LLaMA's tokenizer shape, small: <unk> <s> </s>, the 256 byte tokens, learned pieces."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False, special_tokens=["<unk>"])
    learner.train_from_iterator([c.replace("\n", " ") for c in CORPUS], trainer)  # <0x0A>
    learned = json.loads(learner.to_str())["model"]
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    pieces = [p for p, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]) if p != "<unk>"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *bytes_, *pieces])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))  # fmt: skip
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<unk>", "<s>", "</s>")])  # fmt: skip
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])  # fmt: skip
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    return tok


def sentencepiece_folder(folder: Path, name: str | None = "llama2") -> Path:
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None, "legacy": True,
              "clean_up_tokenization_spaces": False, "model_max_length": 2048,
              "tokenizer_class": "LlamaTokenizer", "use_default_system_prompt": False}  # fmt: skip
    if name is not None:
        config["chat_template"] = template(name)
    return _save(sentencepiece_tokenizer(), folder, config)


def gemma_folder(folder: Path) -> Path:
    """Gemma's shape: LLaMA's byte-fallback BPE without the prepended "▁", <pad> <eos> <bos>
    <unk> first, <start_of_turn> and <end_of_turn> special, <bos> put first; its template
    (no system role, the assistant's turn named "model", each turn ended by <end_of_turn>)."""
    from tokenizers import AddedToken, Tokenizer, normalizers, processors

    base = json.loads(sentencepiece_tokenizer().to_str())["model"]
    old = sorted(base["vocab"], key=base["vocab"].get)[3:]  # after <unk> <s> </s>
    first = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    base["vocab"] = {t: i for i, t in enumerate([*first, *old])}
    tok = Tokenizer.from_str(json.dumps({**json.loads(sentencepiece_tokenizer().to_str()),
                                         "model": base, "added_tokens": []}))  # fmt: skip
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in first])
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos>:0 $A:0", pair="<bos>:0 $A:0 <bos>:1 $B:1", special_tokens=[("<bos>", 2)]
    )
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>",
              "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
              "chat_template": template("gemma"), "model_max_length": 8192,
              "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    return _save(tok, folder, config)


def family_folder(root: Path, family: str) -> Path:
    """The tokenizer folder a family ships, with its chat template."""
    folder = root / family
    if family == "gemma":
        return gemma_folder(folder)
    if family in ("llama2", "mistral", "zephyr"):
        return sentencepiece_folder(folder, family)
    if family.startswith("llama3"):
        return llama3_folder(folder, family)
    return qwen_folder(folder) if family == "qwen2.5" else gpt2_folder(folder)
