"""Bad instruction data: one line naming the file, line and values, exit 2, nothing written.
Every check runs in the calling process (`data prepare`) or on the index alone (train's
launcher check, in test_instruct_packing.py); no process is started here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from instruct_data import CHATS, LLAMA_TEMPLATE, ROWS, tokenizer_folder, write_jsonl
from plait.cli import main
from plait.config import Config, validate_config
from plait.errors import ConfigError


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return tokenizer_folder(tmp_path_factory.mktemp("tok"), LLAMA_TEMPLATE)


def _fails(capsys, tmp_path: Path, data: Path | None, tok: Path | None, *extra: str,
           fmt: str = "alpaca") -> str:  # fmt: skip
    argv = ["data", "prepare", "--format", fmt, "--out", str(tmp_path / "out"), "--no-progress"]
    argv += ["--data", str(data)] if data else []
    argv += ["--tokenizer", str(tok)] if tok else []
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("plait: error:") == 1 and len(err.strip().splitlines()) <= 3
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    return " ".join(err.split())


def test_missing_field_and_wrong_type_name_file_and_line(tok, tmp_path, capsys) -> None:
    data = write_jsonl(tmp_path / "a.jsonl", [ROWS[0], {"instruction": "x"}])
    msg = _fails(capsys, tmp_path, data, tok)
    assert f"{data}:2 has no field 'output'; fields: 'instruction'" in msg
    assert "--columns output=NAME" in msg
    data = write_jsonl(tmp_path / "b.jsonl", [ROWS[0], ROWS[1], {"instruction": 3, "output": ""}])
    msg = _fails(capsys, tmp_path, data, tok)
    assert f"{data}:3 field 'instruction' must be a string, got int 3" in msg
    data = write_jsonl(tmp_path / "c.jsonl", [["not", "an", "object"]])
    assert f"{data}:1 is a list, not a JSON object" in _fails(capsys, tmp_path, data, tok)
    msg = _fails(capsys, tmp_path, write_jsonl(tmp_path / "d.jsonl", ROWS), tok,
                 "--columns", "output=completion")  # fmt: skip
    assert "d.jsonl:1 has no field 'completion'" in msg
    msg = _fails(capsys, tmp_path, data, tok, "--columns", "answer=completion")
    assert "--columns 'answer=completion': 'answer=completion' is not FIELD=NAME" in msg


def test_invalid_json_names_the_line(tok, tmp_path, capsys) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"instruction": "x", "output": \n')
    assert f"{data}:3:32 is not valid JSON (Expecting value)" in _fails(capsys, tmp_path, data, tok)
    array = tmp_path / "bad.json"
    text = json.dumps(ROWS, indent=2)
    array.write_text(text.replace('"Add the numbers."', '"Add the numbers.,'))
    line = text[: text.index("Add the numbers.")].count("\n") + 1
    msg = _fails(capsys, tmp_path, array, tok)
    assert f"{array}:{line}:" in msg and "is not valid JSON" in msg
    array.write_text(json.dumps(ROWS, indent=1).replace('"output": "5"', '"output": 5'))
    lines = json.dumps(ROWS, indent=1).split("\n")
    line = [i for i, text in enumerate(lines, 1) if text == " {"][1]  # the second row's {
    assert f"{array}:{line} field 'output' must be a string" in _fails(capsys, tmp_path, array, tok)


def test_empty_files(tok, tmp_path, capsys) -> None:
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n  \n")
    assert f"data file '{empty}' is empty" in _fails(capsys, tmp_path, empty, tok)
    empty.write_text("")
    assert f"data file '{empty}' is empty" in _fails(capsys, tmp_path, empty, tok)
    array = tmp_path / "e.json"
    array.write_text("[ ]")
    assert "holds no examples (an empty array)" in _fails(capsys, tmp_path, array, tok)
    assert "--format alpaca needs --data FILE" in _fails(capsys, tmp_path, None, tok)


def test_chat_rows(tok, tmp_path, capsys) -> None:
    no_answer = [{"messages": CHATS[0]}, {"messages": [{"role": "user", "content": "hi"}]}]
    data = write_jsonl(tmp_path / "c.jsonl", no_answer)
    msg = _fails(capsys, tmp_path, data, tok, fmt="chat")
    assert f"{data}:2 has no assistant turn (roles: user)" in msg
    data = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user"}]}])
    assert f"{data}:1 message 0 must be an object with string role and content" in _fails(
        capsys, tmp_path, data, tok, fmt="chat"
    )
    bad_role = [
        {"messages": CHATS[0]},
        {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
    ]
    data = write_jsonl(tmp_path / "r.jsonl", bad_role)
    msg = _fails(capsys, tmp_path, data, tok, fmt="chat")
    assert f"{data}:2: chat template of '{tok}' fails to render: TemplateError: unknown role" in msg


def test_tokenizers_that_cannot_serve_the_format(tok, tmp_path, capsys) -> None:
    data = write_jsonl(tmp_path / "a.jsonl", ROWS)
    assert "--format alpaca needs --tokenizer with an end-of-sequence token; the byte " \
        "tokenizer has none" in _fails(capsys, tmp_path, data, None)  # fmt: skip
    no_eos = tmp_path / "noeos"
    no_eos.mkdir()
    spec = json.loads((tok / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "</s>"]
    spec["model"]["vocab"].pop("</s>")
    (no_eos / "tokenizer.json").write_text(json.dumps(spec))
    msg = _fails(capsys, tmp_path, data, no_eos)
    assert "has no end-of-sequence token" in msg and "--format alpaca ends every response" in msg
    plain = tokenizer_folder(tmp_path / "plain", None)
    chats = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}])
    msg = _fails(capsys, tmp_path, chats, plain, fmt="chat")
    assert "--format chat needs a chat template: tokenizer folder" in msg
    assert "--chat-template is for --format chat, not alpaca" in _fails(
        capsys, tmp_path, data, tok, "--chat-template", "t.jinja"
    )


def test_text_format_refuses_instruction_flags(tmp_path, capsys) -> None:
    text = tmp_path / "t.txt"
    text.write_text("plain text\n")
    msg = _fails(capsys, tmp_path, text, None, "--train-on-input", fmt="text")
    assert "--train-on-input is for --format alpaca or chat, not text" in msg


def test_config_long_has_two_values() -> None:
    cfg = Config()
    cfg.data.long = "cut"
    with pytest.raises(ConfigError, match="long must be one of truncate, drop; got 'cut'"):
        validate_config(cfg)


def test_templates_reading_unpassed_names_and_an_eos_not_read_as_one_token(tmp_path, capsys):
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}])
    odd = tmp_path / "odd.jinja"
    odd.write_text("{{ messages[0]['content'] }}{% if enable_thinking %}x{% endif %}")
    plain = tokenizer_folder(tmp_path / "plain", None)
    msg = _fails(capsys, tmp_path, data, plain, "--chat-template", str(odd), fmt="chat")
    assert f"{data}:1: chat template '{odd}' reads 'enable_thinking', which plait" in msg
    wrong = tokenizer_folder(tmp_path / "wrong", None, eos_token="Ġthe")  # a vocabulary piece
    alpaca = write_jsonl(tmp_path / "a.jsonl", ROWS)
    msg = _fails(capsys, tmp_path, alpaca, wrong)
    assert f"{alpaca}:1: tokenizer '{wrong / 'tokenizer.json'}' does not read its EOS 'Ġthe'" in msg
