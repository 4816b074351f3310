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


SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
ENDS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")


def _ours(folder: Path) -> ChatTemplate:
    return ChatTemplate.load(None, folder, SPECIALS, ENDS)


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


def test_spans_are_the_assistant_text_and_its_end_of_turn(folder) -> None:
    ours = _ours(folder)
    for chat in CHATS:
        text, spans = ours.spans(chat)
        assert text == ours.render(chat, False)
        targets = [text[a:b] for a, b in spans]
        answers = [m["content"] for m in chat if m["role"] == "assistant"]
        assert len(targets) == len(answers)
        for target, answer in zip(targets, answers, strict=True):
            assert answer in target and "user" not in target and "[INST]" not in target
    # ChatML: content + <|im_end|>, not the "\n" after it; Llama: ' content </s>'
    text, spans = ours.spans(CHATS[0])
    assert text[slice(*spans[0])] in ("hi, how are you?<|im_end|>", " hi, how are you? </s>")


def test_a_template_that_renders_the_last_turn_apart_is_refused(tmp_path) -> None:
    odd = (
        "{% for m in messages %}{% if loop.last %}LAST:{% endif %}{{ m['content'] }}\n{% endfor %}"
    )
    ours = ChatTemplate(odd, "'odd.jinja'")
    with pytest.raises(ConfigError, match=r"f.jsonl:3: chat template 'odd.jinja' does not "
                       r"render the conversation up to message 1"):  # fmt: skip
        ours.spans(CHATS[0], "f.jsonl:3: ")


def test_template_failures_are_one_line(tmp_path) -> None:
    ours = ChatTemplate(LLAMA_TEMPLATE, "'t'", SPECIALS)
    bad = [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]
    with pytest.raises(ConfigError, match=r"^d.jsonl:7: chat template 't' fails to render: "
                       r"TemplateError: unknown role tool$"):  # fmt: skip
        ours.spans(bad, "d.jsonl:7: ")
    with pytest.raises(ConfigError, match="chat template 'u' does not compile"):
        ChatTemplate("{% for %}", "'u'")
    no_template = tokenizer_folder(tmp_path / "plain", None)
    with pytest.raises(ConfigError, match=r"--format chat needs a chat template: tokenizer "
                       r"folder .*plain' has none .* --chat-template FILE"):  # fmt: skip
        ChatTemplate.load(None, no_template, SPECIALS)
    with pytest.raises(ConfigError, match=r"chat template file 'nope.jinja' does not exist"):
        ChatTemplate.load("nope.jinja", no_template, SPECIALS)
    file = tmp_path / "t.jinja"
    file.write_text(CHATML_TEMPLATE)
    assert ChatTemplate.load(str(file), no_template).text == CHATML_TEMPLATE


def test_sandbox_refuses_attribute_escapes() -> None:
    ours = ChatTemplate("{{ messages.__class__.__mro__ }}", "'x'")
    with pytest.raises(ConfigError, match="fails to render: SecurityError"):
        ours.render(CHATS[0], False)


def test_a_name_nobody_passes_is_refused_naming_it() -> None:
    text = "{{ bos_token }}{% if enable_thinking %}think{% endif %}"
    ours = ChatTemplate(text, "'q'", SPECIALS)
    want = (r"^f:2: chat template 'q' reads 'enable_thinking', which plait does not provide "
            r"\(it passes messages, add_generation_prompt, tools, documents, bos_token, "
            r"eos_token; transformers fills other names only from extra apply_chat_template "
            r"arguments\)$")  # fmt: skip
    with pytest.raises(ConfigError, match=want):
        ours.render(CHATS[0], False, "f:2: ")
    for used in ("{{ pad_token }}", "{{ x + 'a' }}", "{% for t in x %}{% endfor %}",
                 "{{ x.y }}", "{{ x | length }}"):  # fmt: skip
        with pytest.raises(ConfigError, match=r"reads '(pad_token|x)'"):
            ChatTemplate(used, "'q'", SPECIALS).render(CHATS[0], False)


def test_tested_names_and_missing_message_keys_render_as_in_transformers(tmp_path) -> None:
    """`is defined`, `default`, `is none` on a name nobody passes, a message's missing key,
    tools/documents (none), today's date, tojson without HTML escaping, loop controls and
    {% generation %} blocks: the text transformers renders."""
    from transformers import PreTrainedTokenizerFast

    text = (
        "{% if not date_string is defined %}{% set date_string = strftime_now('%Y') %}"
        "{% endif %}{{ date_string }}|{{ custom | default('d') }}|{{ x is none }}|"
        "{{ tools is none }}{{ documents is none }}|{% for m in messages %}"
        "{% if m.tool_calls %}T{% endif %}{{ m.name }}{% if loop.index > 1 %}{% break %}"
        "{% endif %}{{ m | tojson }}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% endfor %}"
    )
    folder = tokenizer_folder(tmp_path / "t", text)
    chat = [{"role": "user", "content": "<b>&'\"é", "name": None}, *CHATS[1]]
    theirs = PreTrainedTokenizerFast.from_pretrained(str(folder))
    want = theirs.apply_chat_template(chat, tokenize=False)
    ours = _ours(folder)
    assert ours.render(chat, False) == want and '"<b>&\'\\"é"' in want
    rendered, spans = ours.spans(chat)
    assert rendered == want and [rendered[a:b] for a, b in spans] == ["<b>&'\"é"]
    with pytest.raises(ConfigError, match=r"holds U.FDD0 or U.FDD1"):
        ours.spans([{"role": "user", "content": "\ufdd0"}])


def test_chat_template_jinja_takes_priority_as_in_transformers(tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    folder = tokenizer_folder(tmp_path / "both", LLAMA_TEMPLATE)
    (folder / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    theirs = PreTrainedTokenizerFast.from_pretrained(str(folder))
    want = theirs.apply_chat_template(CHATS[0], tokenize=False)
    assert _ours(folder).render(CHATS[0], False) == want and want.startswith("<|im_start|>")


def test_namespace_and_dict_as_transformers_guards_them() -> None:
    text = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
            "{% endfor %}{{ ns.n }}{{ dict(a=1) | tojson }}"
            "{{ dict.fromkeys(['b']) | tojson }}")  # fmt: skip
    assert ChatTemplate(text, "'n'").render(CHATS[1], False) == '5{"a": 1}{"b": null}'
    for bad in ("{% set ns = namespace(_x=1) %}", "{% set ns = namespace() %}{% set ns._y = 1 %}"):
        with pytest.raises(ConfigError, match="SecurityError: a chat template cannot set '_"):
            ChatTemplate(bad, "'n'").render(CHATS[1], False)
