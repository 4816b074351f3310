"""Instruction files read strictly, nothing lost: a JSON array is what `json.loads` (Stanford's
`jload`) accepts, each refusal naming the file, line and column json gives; JSONL is read line
by line; a role no template knows is refused, and messages a template leaves out are counted
in the summary; "nothing left" names the cause and the user's path. No process is started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from instruct_data import CHATML_TEMPLATE, LLAMA_TEMPLATE, ROWS, tokenizer_folder, write_jsonl
from plait.cli import main
from plait.data.examples import check_examples
from plait.data.records import parse_columns, read_records
from plait.errors import ConfigError

ALPACA = parse_columns(None, "alpaca")
ARRAY = json.dumps(ROWS, indent=2)
LAST = ARRAY.rindex("}")  # the last row's closing brace
BROKEN = {
    "trailing comma": ARRAY[: LAST + 1] + ",\n]",
    "missing comma": ARRAY.replace("},\n  {", "}\n  {", 1),
    "extra comma": ARRAY.replace("},\n  {", "},,\n  {", 1),
    "junk after ]": ARRAY + "\nx",
    "cat a.json b.json": ARRAY + "\n" + json.dumps(ROWS[:1], indent=2) + "\n",
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_what_json_load_refuses_is_refused_at_its_line_and_column(case, tmp_path) -> None:
    file = tmp_path / "rows.json"
    file.write_text(BROKEN[case])
    with pytest.raises(json.JSONDecodeError) as reference:
        json.loads(BROKEN[case])  # Stanford's jload: json.load
    with pytest.raises(ConfigError) as e:
        read_records(file, "alpaca", ALPACA)
    where = f"{file}:{reference.value.lineno}:{reference.value.colno}"
    assert str(e.value).startswith(where), (str(e.value), where)


def test_the_refusals_say_what_is_wrong(tmp_path) -> None:
    file = tmp_path / "rows.json"
    said = {}
    for case, text in BROKEN.items():
        file.write_text(text)
        with pytest.raises(ConfigError) as e:
            read_records(file, "alpaca", ALPACA)
        said[case] = str(e.value)
    assert "a comma before ']' (a trailing comma)" in said["trailing comma"]
    assert "(Expecting ',' delimiter)" in said["missing comma"]
    assert "two commas" in said["extra comma"]
    assert "text ('x') after the array's closing ']' on line" in said["junk after ]"]
    last = ARRAY.count("\n") + 1
    assert (
        f"another JSON document after the array's closing ']' on line {last}"
        in said["cat a.json b.json"]
    )
    assert "joined with cat" in said["cat a.json b.json"]


def test_a_valid_array_keeps_every_row_and_its_line(tmp_path) -> None:
    file = tmp_path / "rows.json"
    file.write_text(ARRAY)
    records = read_records(file, "alpaca", ALPACA)
    assert [r.fields["instruction"] for r in records] == [r["instruction"] for r in ROWS]
    starts = [i for i, line in enumerate(ARRAY.split("\n"), 1) if line == "  {"]
    assert [r.where for r in records] == [f"{file}:{n}" for n in starts]


def test_jsonl_is_read_line_by_line_and_nothing_is_lost(tmp_path) -> None:
    rows = [{**ROWS[0], "output": "one\u2028two\x85three"}, ROWS[1]]  # JSON allows them raw
    file = tmp_path / "rows.jsonl"
    file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows))
    records = read_records(file, "alpaca", ALPACA)
    assert [r.fields["output"] for r in records] == [r["output"] for r in rows]
    assert [r.where for r in records] == [f"{file}:1", f"{file}:2"]
    file.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + " " + json.dumps(ROWS[2]))
    with pytest.raises(ConfigError, match=r"rows.jsonl:2:\d+ is not valid JSON \(Extra data\)"):
        read_records(file, "alpaca", ALPACA)


def test_one_object_over_several_lines_is_not_taken_for_jsonl(tmp_path) -> None:
    file = tmp_path / "row.json"
    file.write_text(json.dumps(ROWS[0], indent=2))
    with pytest.raises(ConfigError, match="holds one JSON object over several lines, not rows"):
        read_records(file, "alpaca", ALPACA)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> Path:
    return tokenizer_folder(tmp_path_factory.mktemp("chatml"), CHATML_TEMPLATE)


def _prepare(data: Path, tok: Path, out: Path, capsys, *extra: str) -> tuple[int, str, str]:
    code = main(["data", "prepare", "--format", "chat", "--data", str(data), "--tokenizer",
                 str(tok), "--out", str(out), "--no-progress", *extra])  # fmt: skip
    got = capsys.readouterr()
    return code, got.out, " ".join(got.err.split())


def test_an_unknown_role_is_refused(chatml, tmp_path, capsys) -> None:
    chat = [{"role": "user", "content": "hi"}, {"role": "asistant", "content": "hello"}]
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat}])
    code, _, err = _prepare(data, chatml, tmp_path / "out", capsys)
    assert code == 2 and not (tmp_path / "out").exists()
    assert f"{data}:1 message 1 has role 'asistant', which is none of system, user" in err


def test_messages_a_template_leaves_out_are_counted(tmp_path, capsys) -> None:
    """LLAMA_TEMPLATE renders system, user and assistant; a template that knows only user
    and assistant (a common shape) drops the system and tool turns."""
    only_two = LLAMA_TEMPLATE.replace("{% if message['role'] == 'system' %}", "{% if false %}")
    only_two = only_two.replace("{{ raise_exception('unknown role ' + message['role']) }}", "")
    tok = tokenizer_folder(tmp_path / "tok", only_two)
    chats = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "tool", "content": "calc: 4"}, {"role": "assistant", "content": "4"}],
        [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}],
    ]  # fmt: skip
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in chats])
    code, out, err = _prepare(data, tok, tmp_path / "out", capsys)
    assert code == 0, err
    assert "the chat template leaves out 3 messages (2 system, 1 tool)" in out
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["examples"]["unrendered"] == {"system": 2, "tool": 1}
    code, out, err = _prepare(data, tokenizer_folder(tmp_path / "t2", LLAMA_TEMPLATE.replace(
        "{{ raise_exception('unknown role ' + message['role']) }}", "")),
        tmp_path / "out2", capsys)  # fmt: skip
    assert code == 0 and "the chat template leaves out 1 messages (1 tool)" in out


@pytest.fixture(scope="module")
def sft(chatml, tmp_path_factory) -> Path:
    """ROWS prepared as Alpaca examples (12 of them)."""
    root = tmp_path_factory.mktemp("sft")
    data = write_jsonl(root / "rows.jsonl", ROWS * 4)
    assert main(["data", "prepare", "--format", "alpaca", "--data", str(data), "--tokenizer",
                 str(chatml), "--out", str(root / "sft"), "--no-progress"]) == 0  # fmt: skip
    return root / "sft"


def test_nothing_left_under_long_drop_says_so(sft, capsys) -> None:
    capsys.readouterr()
    lengths = json.loads((sft / "index.json").read_text())["examples"]["lengths"]
    shortest, seq = min(lengths), min(lengths) - 2
    with pytest.raises(ConfigError) as e:
        check_examples(sft, seq, 0.25, True, "drop", 1)
    assert str(e.value) == (
        f"examples {str(sft)!r}: every one of the 12 examples is longer than seq_len {seq} + 1 "
        f"tokens (the shortest has {shortest}), and --long drop leaves them all out: give "
        f"--seq-len {shortest - 1} or more, or --long truncate"
    )
    longest = max(lengths)
    some = sum(n > longest - 1 for n in lengths)
    with pytest.raises(ConfigError, match=rf"\(--long drop left out {some} of 12 examples, lon"):
        check_examples(sft, longest - 2, 0.25, True, "drop", 100)
    assert check_examples(sft, longest, 0.25, False, "drop", 1) == (9, 3)
