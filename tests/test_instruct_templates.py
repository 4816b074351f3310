"""Prompt templates: Stanford's Alpaca text exactly, and chat rendering equal to transformers'
`apply_chat_template` (the same folder loaded by transformers is the reference), with the
assistant turns found by rendering prefixes."""

from __future__ import annotations

from pathlib import Path

import pytest

from instruct_data import CHATML_TEMPLATE, CHATS, LLAMA_TEMPLATE, tokenizer_folder
from plait.data.templates import ChatTemplate, alpaca_identity, alpaca_prompt
from plait.errors import ConfigError


def test_alpaca_prompts_are_stanfords() -> None:
    assert alpaca_prompt("Add the numbers.", "2 and 3") == (
        "Below is an instruction that describes a task, paired with an input that provides "
        "further context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:"
    )
    expected = (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nSay hi\n\n### Response:"
    )
    assert alpaca_prompt("Say hi", "") == expected  # Stanford: an empty input is no input
    assert alpaca_prompt("Say hi", None) == expected
    assert alpaca_prompt("{input} braces", "").startswith("Below")  # no second formatting
    assert "{input} braces" in alpaca_prompt("{input} braces", "")
    assert len(alpaca_identity()["sha256"]) == 64


@pytest.fixture(scope="module", params=["llama", "chatml"])
def folder(request, tmp_path_factory) -> Path:
    template = LLAMA_TEMPLATE if request.param == "llama" else CHATML_TEMPLATE
    return tokenizer_folder(tmp_path_factory.mktemp(request.param), template)


def _ours(folder: Path) -> ChatTemplate:
    return ChatTemplate.load(None, folder, "<s>", "</s>")


@pytest.mark.parametrize("generation", [False, True])
def test_rendering_equals_transformers(folder, generation) -> None:
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast.from_pretrained(str(folder))
    ours = _ours(folder)
    for chat in CHATS:
        expected = theirs.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=generation
        )
        assert ours.render(chat, generation) == expected


def test_turns_cut_the_rendering_at_the_assistant_text(folder) -> None:
    ours = _ours(folder)
    for chat in CHATS:
        turns = ours.turns(chat)
        assert "".join(t.text for t in turns) == ours.render(chat, False)
        targets = [t.text for t in turns if t.target]
        answers = [m["content"] for m in chat if m["role"] == "assistant"]
        assert len(targets) == len(answers)
        for text, answer in zip(targets, answers, strict=True):
            assert answer in text  # the turn's text and the template's end of turn
            assert "user" not in text and "[INST]" not in text
    # the ChatML turn is exactly content + end of turn; Llama's ' content </s>'
    first = next(t.text for t in ours.turns(CHATS[0]) if t.target)
    assert first in ("hi, how are you?<|im_end|>\n", " hi, how are you? </s>")


def test_a_template_that_renders_the_last_turn_apart_is_refused(tmp_path) -> None:
    odd = (
        "{% for m in messages %}{% if loop.last %}LAST:{% endif %}{{ m['content'] }}\n{% endfor %}"
    )
    ours = ChatTemplate(odd, "'odd.jinja'", None, None)
    with pytest.raises(ConfigError, match=r"f.jsonl:3: chat template 'odd.jinja' does not "
                       r"render the conversation up to message 1"):  # fmt: skip
        ours.turns(CHATS[0], "f.jsonl:3: ")


def test_template_failures_are_one_line(tmp_path) -> None:
    ours = ChatTemplate(LLAMA_TEMPLATE, "'t'", "<s>", "</s>")
    bad = [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]
    with pytest.raises(ConfigError, match=r"^d.jsonl:7: chat template 't' fails to render: "
                       r"TemplateError: unknown role tool$"):  # fmt: skip
        ours.turns(bad, "d.jsonl:7: ")
    with pytest.raises(ConfigError, match="chat template 'u' does not compile"):
        ChatTemplate("{% for %}", "'u'", None, None)
    no_template = tokenizer_folder(tmp_path / "plain", None)
    with pytest.raises(ConfigError, match=r"--format chat needs a chat template: tokenizer "
                       r"folder .*plain' has none .* --chat-template FILE"):  # fmt: skip
        ChatTemplate.load(None, no_template, "<s>", "</s>")
    with pytest.raises(ConfigError, match=r"chat template file 'nope.jinja' does not exist"):
        ChatTemplate.load("nope.jinja", no_template, "<s>", "</s>")
    file = tmp_path / "t.jinja"
    file.write_text(CHATML_TEMPLATE)
    assert ChatTemplate.load(str(file), no_template, None, None).text == CHATML_TEMPLATE


def test_sandbox_refuses_attribute_escapes() -> None:
    ours = ChatTemplate("{{ messages.__class__.__mro__ }}", "'x'", None, None)
    with pytest.raises(ConfigError, match="fails to render: SecurityError"):
        ours.render(CHATS[0], False)
