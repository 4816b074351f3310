"""Prepared chat and Alpaca tokens equal the references' for every tokenizer family shape
(tests/chat_families.py: byte-level Llama-3/3.1/3.2, Qwen2.5, GPT-2; SentencePiece-style
Llama-2, Mistral, Zephyr), and the targets follow the stated rule: the rendered conversation
tokenized once, as transformers' `apply_chat_template(tokenize=True)`; each assistant turn's
text after the generation prompt up to its end-of-turn token is a target (not the template's
whitespace after that token), a token overlapping it too; Alpaca as Stanford's train.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from chat_families import FAMILIES, family_folder, sentencepiece_folder, template
from chat_reference import rule_mask, stanford
from plait.data.instruct import Tokenized, target_mask
from plait.data.records import Record
from plait.data.templates import alpaca_prompt
from plait.data.tokenizer import resolve_tokenizer

pytest.importorskip("transformers")

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Be brief."}
CHATS = [
    [SYSTEM, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "hi, how are you?"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."},
     {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"},
     {"role": "user", "content": "thanks"}],
    [{"role": "user", "content": "  leading and trailing spaces  "},
     {"role": "assistant", "content": "  spaced answer \t "}],
    [{"role": "user", "content": "\nleading newline"},
     {"role": "assistant", "content": "\n\nanswer after newlines\n"}],
    [{"role": "system", "content": "Be brief. 日本語"},
     {"role": "user", "content": "café? cafe\u0301 🙂"},
     {"role": "assistant", "content": "Oui, café ☕ — naïve résumé 日本語 🙂"}],
    [{"role": "user", "content": "def add(a, b):"},
     {"role": "assistant", "content": "return a + b"},
     {"role": "user", "content": "and an empty answer?"}, {"role": "assistant", "content": ""}],
]  # fmt: skip
ROWS = [
    {"instruction": "Give three tips for staying healthy.", "input": "",
     "output": "1. Eat well.\n2. Exercise.\n3. Sleep."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Say hi", "input": "", "output": " hi there  "},
    {"instruction": "Translate: café", "input": "日本語 🙂", "output": ":) naïve résumé"},
    {"instruction": "Name a C++ scope.", "input": "", "output": "::x"},  # "::" spans
]  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: family_folder(root, family) for family in FAMILIES}


def _chats(family: str) -> list[list[dict]]:
    """The conversations a family's template takes (Mistral's and Gemma's refuse system
    messages)."""
    if family not in ("mistral", "gemma"):
        return CHATS
    return [[m for m in c if m["role"] != "system"] for c in CHATS]


def _theirs(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _ours(folder: Path, fmt: str, records: list[dict], chat_template: str | None = None):
    tok = Tokenized(fmt, resolve_tokenizer(folder), chat_template)
    recs = [Record(f"r:{i}", r) for i, r in enumerate(records)]
    return tok, tok.encode(recs, [tok.texts(r) for r in recs])


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_tokens_equal_apply_chat_template_and_targets_the_rule(folders, family) -> None:
    tok, chats = _theirs(folders[family]), _chats(family)
    ours, examples = _ours(folders[family], "chat", [{"messages": c} for c in chats])
    for chat, ex in zip(chats, examples, strict=True):
        assert ex.tokens.tolist() == tok.apply_chat_template(chat, return_dict=False)
        assert ex.mask.tolist() == rule_mask(tok, chat)
        first = next(i for i, m in enumerate(chat) if m["role"] == "assistant")
        want = tok.apply_chat_template(chat[:first], return_dict=False, add_generation_prompt=True)
        assert ours.prompt_ids({"messages": chat[:first]}).tolist() == want
        assert ex.prompt == int(np.argmax(ex.mask))


# docs/finetuning.md's table: the end of each family's rendering of ASKED, the target in ⟦⟧.
ASKED = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]
TURNS = {
    "llama2": "<s>[INST] What is 2+2? [/INST]⟦ It is 4. </s>⟧",
    "mistral": "<s>[INST] What is 2+2? [/INST]⟦It is 4.</s>⟧",
    "zephyr": "<|user|>\nWhat is 2+2?</s>\n<|assistant|>\n⟦It is 4.</s>⟧\n",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n⟦It is 4.<|eot_id|>⟧",
    "llama3.1": "<|start_header_id|>assistant<|end_header_id|>\n\n⟦It is 4.<|eot_id|>⟧",
    "llama3.2": "<|start_header_id|>assistant<|end_header_id|>\n\n⟦It is 4.<|eot_id|>⟧",
    "qwen2.5": "<|im_start|>assistant\n⟦It is 4.<|im_end|>⟧\n",
    "gpt2": "<|im_start|>assistant\n⟦It is 4.<|im_end|>⟧\n",
    "gemma": "<start_of_turn>model\n⟦It is 4.<end_of_turn>⟧\n",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_target_is_the_turn_and_its_end_of_turn_token(folders, family) -> None:
    tok = _theirs(folders[family])
    ours, (ex,) = _ours(folders[family], "chat", [{"messages": ASKED}])
    text, ((a, b),) = ours.template.spans(ASKED)
    assert (text[:a] + "⟦" + text[a:b] + "⟧" + text[b:]).endswith(TURNS[family])
    said = tok.decode(ex.tokens[ex.mask > 0].tolist(), skip_special_tokens=False)
    assert said.lstrip() == text[a:b].lstrip()  # a SentencePiece decode drops a first space


@pytest.mark.parametrize(
    ("family", "generation"),
    [("qwen2.5", "qwen2.5-generation"), ("llama3.1", "llama3.1-generation")],
)
def test_the_rule_equals_transformers_assistant_mask(folders, family, generation, tmp_path):
    """A {% generation %} version of the family's template marks exactly the rule's text:
    transformers' return_assistant_tokens_mask on it equals plait's targets on the plain
    template, and plait reads the generation blocks the same way."""
    tok = _theirs(folders[family])
    marked = tmp_path / "gen.jinja"
    marked.write_text(template(generation))
    records = [{"messages": c} for c in CHATS]
    _, plain = _ours(folders[family], "chat", records)
    _, blocks = _ours(folders[family], "chat", records, str(marked))
    for chat, a, b in zip(CHATS, plain, blocks, strict=True):
        out = tok.apply_chat_template(chat, chat_template=template(generation),
                                      return_assistant_tokens_mask=True)  # fmt: skip
        assert out["input_ids"] == a.tokens.tolist()  # the two templates render alike
        assert b.tokens.tolist() == out["input_ids"]
        assert b.mask.tolist() == [0, *out["assistant_masks"][1:]]
        assert a.mask.sum() == b.mask.sum()


def test_a_token_across_the_boundary_is_a_target(folders) -> None:
    """ChatML's generation prompt ends in "\\n"; a turn starting with "\\n" makes one token of
    both ("ĊĊ", as apply_chat_template does): it is a target, since the model writes it."""
    tok = _theirs(folders["qwen2.5"])
    chat = CHATS[3]
    _, (ex,) = _ours(folders["qwen2.5"], "chat", [{"messages": chat}])
    prompt = tok.apply_chat_template(chat[:1], return_dict=False, add_generation_prompt=True)
    k = ex.prompt
    assert ex.tokens[:k].tolist() == prompt[:-1] and ex.tokens[k] != prompt[-1]
    assert tok.convert_ids_to_tokens(int(ex.tokens[k])) == "ĊĊĊ"  # "\n" + the content's "\n\n"
    assert target_mask([(0, 2), (2, 4), (4, 4)], [(1, 3)]).tolist() == [1, 1, 0]
    assert target_mask([(0, 1), (3, 3), (3, 5)], [(3, 5)]).tolist() == [0, 0, 1]


@pytest.mark.parametrize("family", ["llama2", "llama3", "qwen2.5", "gpt2"])
def test_alpaca_tokens_are_stanfords_construction(folders, tmp_path, family) -> None:
    """The LLaMA-7B recipe's tokenizer shape (SentencePiece with byte fallback, <s> first),
    and byte-level ones: the same tokens, targets from the prompt's token count on."""
    folder = folders[family]
    if family == "llama2":
        folder = sentencepiece_folder(tmp_path / "llama", None)  # as LLaMA-7B's: no template
    tok = _theirs(folder)
    ours, examples = _ours(folder, "alpaca", ROWS)
    for row, ex in zip(ROWS, examples, strict=True):
        ids, labels = stanford(tok, row)
        assert ex.tokens.tolist() == ids and ex.prompt == labels.count(-100)
        assert np.where(ex.mask > 0, ex.tokens.astype(np.int64), -100).tolist() == labels
        fields = {"instruction": row["instruction"], "input": row["input"]}
        want = tok(alpaca_prompt(row["instruction"], row["input"]))["input_ids"]
        assert ours.prompt_ids(fields).tolist() == want
    if family == "llama2":
        assert examples[0].tokens[0] == tok.bos_token_id and tok.bos_token_id == 1
        # a LLaMA folder without `legacy` (transformers 5 then reads it as legacy: false)
        # tokenizes Alpaca text alike: no text follows a special token in it
        config = json.loads((folder / "tokenizer_config.json").read_text())
        del config["legacy"]
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        tok = _theirs(folder)
        assert [ex.tokens.tolist() for ex in examples] == [stanford(tok, r)[0] for r in ROWS]
    # Stanford's boundary is the prompt's token count: "Response:" + "::x" has a "::" token
    # across it, which falls within that count, so it is the prompt's, and ":" "x" EOS the
    # targets (the response's first ":" is never a target: Stanford's labels do the same)
    ex = examples[-1]
    k = ex.prompt
    assert tok.convert_ids_to_tokens(ex.tokens[k - 1 : k + 1].tolist()) == ["::", ":"]
    assert ex.mask[k - 1] == 0 and ex.mask[k:].all()


def test_llama32_date_is_todays_as_transformers(folders) -> None:
    from datetime import datetime

    tok = _theirs(folders["llama3.2"])
    ours, _ = _ours(folders["llama3.2"], "chat", [{"messages": CHATS[0]}])
    text = ours.template.render(CHATS[0], True)
    assert text == tok.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}\n" in text
    assert "26 Jul 2024" in _ours(folders["llama3.1"], "chat", [])[0].template.render(
        CHATS[0], True
    )


def test_a_legacy_false_llama_folder_reads_as_its_tokenizer_json(tmp_path) -> None:
    """plait reads tokenizer.json as `tokenizers` does. transformers 5 does too for these
    folders as shipped with `legacy: true` (above), and always through
    PreTrainedTokenizerFast; but for `tokenizer_class: LlamaTokenizer` with `legacy: false`
    it rebuilds the pipeline (a Metaspace that adds "▁" only at the very start), so after a
    special token it writes "[" where the file (and SentencePiece) gives "▁[" (this small
    vocabulary has neither piece: "▁" then the byte of "[")."""
    from transformers import PreTrainedTokenizerFast

    folder = sentencepiece_folder(tmp_path / "llama2", "llama2")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"legacy": False}))
    chat = CHATS[1][:2]
    _, (ex,) = _ours(folder, "chat", [{"messages": chat}])
    ours = ex.tokens.tolist()
    file = PreTrainedTokenizerFast.from_pretrained(str(folder))
    assert ours == file.apply_chat_template(chat, return_dict=False)
    auto = _theirs(folder)
    theirs = auto.apply_chat_template(chat, return_dict=False)
    assert file.convert_ids_to_tokens(ours[:3]) == ["<s>", "▁", "<0x5B>"]  # "▁["
    assert auto.convert_ids_to_tokens(theirs[:2]) == ["<s>", "<0x5B>"]  # "["
    assert ours[2:] == theirs[1:]
