"""The references' tokens and targets, from transformers alone (no tests here): Stanford
Alpaca's train.py construction, and the chat rule on `apply_chat_template`'s text and
offsets."""

from __future__ import annotations

from plait.data.templates import alpaca_prompt


def stanford(tok, row: dict) -> tuple[list[int], list[int]]:
    """Stanford's train.py: input_ids = tokenizer(prompt + output + eos_token) and labels
    with the first len(tokenizer(prompt)) ids ignored (both with the special tokens)."""
    prompt = alpaca_prompt(row["instruction"], row.get("input"))
    ids = tok(prompt + row["output"] + tok.eos_token)["input_ids"]
    boundary = len(tok(prompt)["input_ids"])
    return ids, [-100] * boundary + ids[boundary:]


def rule_mask(tok, chat: list[dict]) -> list[int]:
    """The chat rule: each assistant turn's characters between the text rendered with the
    generation prompt and the text with the turn, less the whitespace after a final added
    token; every token (transformers' offsets) overlapping them; never the first token."""
    full = tok.apply_chat_template(chat, tokenize=False)
    specials = [t.content for t in tok.added_tokens_decoder.values() if t.content.strip()]
    spans = []
    for i, m in enumerate(chat):
        if m["role"] == "assistant":
            before = tok.apply_chat_template(chat[:i], tokenize=False, add_generation_prompt=True)
            upto = tok.apply_chat_template(chat[: i + 1], tokenize=False)
            assert upto.startswith(before) and full.startswith(upto)
            turn = upto[len(before) :]
            kept = turn.rstrip()
            ends = kept != turn and any(kept.endswith(s) for s in specials)
            spans.append((len(before), len(before) + len(kept) if ends else len(upto)))
    offsets = tok(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    mask = [int(any(e > a and s < b for a, b in spans)) for s, e in offsets]
    return [0, *mask[1:]]


def chat_labels(tok, chat: list[dict]) -> tuple[list[int], list[int]]:
    """apply_chat_template's ids, and labels: the ids where `rule_mask` says, else -100."""
    ids = tok.apply_chat_template(chat, return_dict=False)
    return ids, [i if m else -100 for i, m in zip(ids, rule_mask(tok, chat), strict=True)]
