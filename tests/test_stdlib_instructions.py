"""`plait data instructions`: documented Python functions as Alpaca records
(data/stdlib_instructions.py), on a small source folder written here and on the stdlib."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from plait.cli import main
from plait.data import stdlib_instructions as si
from plait.errors import ConfigError

BODY = "\n".join(f"    total = total + {i}  # step {i}" for i in range(6))

MOD = f'''"""A module."""
import functools


def add_all(values, start=0) -> int:
    """Add every value to start and return the sum of them all."""

    total = start
{BODY}
    return total


def _private(x):
    """Private helpers are not public functions, so they are skipped."""
{BODY}


def undocumented(x):
{BODY}


def short(x):
    """Too short."""
{BODY}


class Box:
    """A box."""

    @functools.cache
    def scale(self, factor: float = 2.0) -> float:
        """Return the box's size multiplied by factor, cached per factor."""
        size = self.size
        # the multiplied size
        return size * factor * 1.0 + 0.0 - 0.0 * 1 * 1 * 1 * 1 + 0 + 0 + 0

    def only_doc(self):
        """A method whose whole body is its docstring, which leaves nothing to write."""

    async def fetch(
        self, url, timeout=None
    ):
        # a comment before the docstring stays in the output, not in the signature
        """Fetch url asynchronously and return the response body, decoded as text."""
        response = await self.session.get(url)
        return (await response.read()).decode("utf-8") + "" + "" + ""
'''


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A package: a module with kept and dropped functions, a near copy of it (its methods
    duplicates), a test folder, a private module and a file that is not valid Python (all
    three skipped), and a folder with nothing documented."""
    root = tmp_path / "src"
    (root / "pkg" / "tests").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text(MOD)
    (root / "pkg" / "same.py").write_text(MOD.replace("total = start\n", "total = +start\n"))
    (root / "pkg" / "tests" / "test_mod.py").write_text(MOD)
    (root / "pkg" / "_private.py").write_text(MOD)
    (root / "pkg" / "broken.py").write_text("def f(:\n")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "m.py").write_text(f"def undocumented(x):\n{BODY}\n")
    return root


def test_records_fields_and_counts(source: Path) -> None:
    records, counts = si.build(source)
    scale = (
        "@functools.cache\ndef scale(self, factor: float = 2.0) -> float:\n"
        "    size = self.size\n    # the multiplied size\n"
        "    return size * factor * 1.0 + 0.0 - 0.0 * 1 * 1 * 1 * 1 + 0 + 0 + 0"
    )
    assert [r["input"] for r in records] == [
        "def add_all(values, start=0) -> int:",
        "def scale(self, factor: float = 2.0) -> float:",  # as written, not as unparsed
        "async def fetch(\n    self, url, timeout=None\n):",
        "def add_all(values, start=0) -> int:",  # same.py's: its body differs
    ]
    first, method = records[0], records[1]
    assert list(first) == ["instruction", "input", "output"]
    assert first["instruction"] == (
        "Write the Python function (module `pkg.mod`) that this docstring describes:\n\n"
        "Add every value to start and return the sum of them all."
    )
    body = f"    total = start\n{BODY}\n    return total"  # the blank line after the docstring too
    assert first["output"] == f"def add_all(values, start=0) -> int:\n{body}"
    assert method["output"] == scale  # decorator kept, dedented, docstring gone
    assert records[2]["output"].startswith(
        records[2]["input"] + "\n    # a comment before the docstring stays"
    )
    assert "method of class `Box` in module `pkg.mod`" in method["instruction"]
    assert "function (module `pkg.same`)" in records[3]["instruction"]
    assert counts.files == 4 and counts.unreadable == 1  # __init__, mod, same, broken
    assert counts.documented == 10 and counts.duplicates == 2  # same.py's methods
    assert counts.dropped == {"docstring too short": 2, "docstring not separable": 2}
    assert counts.kept == 4 and counts.capped == 0
    for record in records:
        ast.parse(record["output"])  # still Python


def test_build_is_deterministic_and_the_cap_spreads_evenly(source: Path) -> None:
    records, _ = si.build(source)
    assert si.build(source)[0] == records
    capped, counts = si.build(source, max_examples=2)
    assert capped == [records[0], records[2]] and counts.capped == 2 and counts.kept == 2


@pytest.mark.parametrize(
    ("limits", "reason"),
    [
        (si.Limits(max_doc_chars=60), "docstring too long"),
        (si.Limits(min_output_lines=6), "output too short"),
        (si.Limits(min_output_chars=200), "output too short"),
        (si.Limits(max_output_lines=5), "output too long"),
        (si.Limits(max_output_chars=200), "output too long"),
        (si.Limits(max_record_chars=400), "record too long"),
    ],
)
def test_each_filter_drops_and_is_counted(source: Path, limits: si.Limits, reason: str) -> None:
    records, counts = si.build(source, limits=limits)
    assert 0 < len(records) < 4 and counts.dropped[reason] > 0
    # the 6 functions the defaults keep or dedup, each counted once: kept, dropped or a copy
    assert len(records) + counts.dropped[reason] + counts.duplicates == 6
    with pytest.raises(ConfigError, match="no documented public function passes the filters"):
        si.build(source, limits=si.Limits(min_output_lines=1000))


def test_the_standard_library_gives_valid_alpaca_records() -> None:
    """The default source: thousands of records, each within the limits, each output valid
    Python without its docstring, no output twice."""
    records, counts = si.build(max_examples=100_000)
    assert counts.kept == len(records) > 1000 and counts.capped == 0
    limits = si.Limits()
    for r in records[:: max(1, len(records) // 300)]:
        assert set(r) == {"instruction", "input", "output"}
        assert r["instruction"].startswith("Write the Python ")
        assert r["input"].startswith(("def ", "async def ")) and r["input"] in r["output"]
        assert limits.min_output_chars <= len(r["output"]) <= limits.max_output_chars
        tree = ast.parse(r["output"]).body[0]
        assert isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef))
        assert ast.get_docstring(tree) is None
    assert len({r["output"] for r in records}) == len(records)


def test_command_writes_jsonl_and_refuses_bad_input(source: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "ins.jsonl"
    argv = ["data", "instructions", "--source", str(source), "--out", str(out)]
    assert main([*argv, "--max-examples", "4"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: 4 examples from 4 files")
    written = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert written == si.build(source, max_examples=4)[0]
    before = out.read_bytes()
    assert main(argv) == 2  # exists
    assert f"--out '{out}' already exists; add --overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--max-examples", "4"]) == 0
    assert out.read_bytes() == before  # deterministic, byte for byte
    bad = [
        (["--source", str(tmp_path / "nope")], "does not exist; give a folder of Python sources"),
        (["--source", str(out)], "is not a folder; give a folder of Python sources"),
        (["--source", str(tmp_path / "bare")], "no documented public function passes"),
        (["--out", str(tmp_path)], "is a folder; give a file path"),
    ]
    for flags, message in bad:
        argv = ["data", "instructions", "--source", str(source), "--out", str(tmp_path / "x")]
        assert main([*argv, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def test_a_statement_with_a_non_str_name_is_not_a_definition() -> None:
    """Python 3.12's `type Alias = int` parses to ast.TypeAlias, whose `name` is an ast.Name
    node: `plait data instructions` crashed on the 3.12 standard library (seen on a GPU host).
    The statement is built by hand so the test runs on 3.10 and 3.11 too."""
    alias = ast.Assign(targets=[], value=ast.Constant(1))
    alias.name = ast.Name(id="Alias")  # the shape of ast.TypeAlias
    fn = ast.parse("def f():\n    '''Doc.'''\n").body[0]
    assert [(o, n.name) for o, n in si._definitions([alias, fn])] == [(None, "f")]
