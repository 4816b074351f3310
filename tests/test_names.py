"""One meaning per name, checked on the source (no process, nothing imported).

A file name appears once in `src/plait` unless docs/architecture.md's "Names" section lists
the files as one subject seen from two layers; a class name is defined once.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "plait"


def shared_file_names(src: Path) -> dict[str, list[str]]:
    """File name -> its paths under `src` (relative), for names held by more than one file."""
    paths: dict[str, list[str]] = defaultdict(list)
    for path in sorted(src.rglob("*.py")):
        if path.name != "__init__.py":
            paths[path.name].append(path.relative_to(src).as_posix())
    return {name: found for name, found in paths.items() if len(found) > 1}


def names_section(doc: str) -> str:
    return doc.split("\n## Names\n", 1)[1].split("\n## ", 1)[0]


def unlisted(shared: dict[str, list[str]], section: str) -> list[str]:
    """The shared files whose path the Names section does not cite."""
    return [p for found in shared.values() for p in found if f"`{p}`" not in section]


def test_every_shared_file_name_is_listed_in_the_architecture():
    section = names_section((ROOT / "docs" / "architecture.md").read_text())
    assert unlisted(shared_file_names(SRC), section) == []


def test_the_check_finds_an_unlisted_pair(tmp_path):
    for folder in ("data", "lessons"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "split.py").write_text("")
        (tmp_path / folder / "__init__.py").write_text("")
    shared = shared_file_names(tmp_path)
    assert shared == {"split.py": ["data/split.py", "lessons/split.py"]}
    assert unlisted(shared, "`data/split.py` only") == ["lessons/split.py"]


def classes_defined_twice(src: Path) -> dict[str, list[str]]:
    """Class name -> the files under `src` defining it at top level, for names defined twice."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(src.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where[node.name].append(path.relative_to(src).as_posix())
    return {name: found for name, found in where.items() if len(found) > 1}


def test_a_class_name_is_defined_once(tmp_path):
    assert classes_defined_twice(SRC) == {}
    (tmp_path / "rows.py").write_text("class Plan:\n    pass\n")
    (tmp_path / "search.py").write_text("class Plan:\n    pass\n\n\nclass Other:\n    pass\n")
    assert classes_defined_twice(tmp_path) == {"Plan": ["rows.py", "search.py"]}
