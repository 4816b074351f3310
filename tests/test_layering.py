"""The architecture's rules, checked on the source (no process, nothing imported):

- no import circle between modules, nor between the rooms of the tree (a top-level module or
  package of `plait`), so every arrow points down;
- nothing under `parallel/` imports the layers above it (train, run, step, launch, cli, lessons),
  nor, directly or through another module, the data package or the pre-launch checks that
  read files (`plait.preflight`): the engines take the configuration's sections, which read
  nothing;
- the pure parts (topology, schedules, estimator, planner, configs, the launcher's
  environment) import no process group;
- `torch.cuda` is touched only in `device.py`;
- collectives are called only in `comm.py`;
- private APIs (a private torch module, another object's `_attribute`) only in
  `torch_private.py`, where each says why and names the public alternative.

docs/architecture.md cites this file; a new rule the architecture adopts is added here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "plait"

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "monitored_barrier",
)
ABOVE_PARALLEL = ("plait.build", "plait.train", "plait.run", "plait.step", "plait.launch",
                  "plait.cli")  # fmt: skip
NOT_UNDER_PARALLEL = ("plait.data", "plait.preflight")
"""What no module under parallel/ reaches, through any chain of imports."""
PURE = ("plait.topology", "plait.schedule", "plait.estimate", "plait.plan", "plait.config",
        "plait.preflight", "plait.launcher_env", "plait.slurm")  # fmt: skip
PROCESS = ("torch.distributed", "plait.comm", "plait.mesh", "plait.launch")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every module `path` imports, at the top or inside a function (a lazy import is still
    an arrow), `from pkg import mod` resolved to the submodule when it is one."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named = {f"{node.module}.{a.name}" for a in node.names}
            found |= named & modules
            if named - modules:  # a name defined in (or handed on by) the module itself
                found.add(node.module)
    return found


def graph() -> dict[str, set[str]]:
    mods = sources()
    names = set(mods)
    return {m: imports_of(p, names) & names - {m} for m, p in mods.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def room(module: str) -> str:
    """plait.parallel.zero.engine -> plait.parallel; plait.step -> plait.step."""
    return ".".join(module.split(".")[:2])


def is_package_face(module: str, src: dict[str, Path]) -> bool:
    return src[module].name == "__init__.py"


def test_no_module_imports_another_in_a_circle():
    assert circles(graph()) == []


def test_rooms_form_no_circle_so_every_arrow_points_down():
    src = sources()
    rooms: dict[str, set[str]] = {}
    for m, targets in graph().items():
        if is_package_face(m, src):  # a package's face hands names on; its rooms' arrows count
            continue
        rooms.setdefault(room(m), set()).update(room(t) for t in targets if room(t) != room(m))
    assert circles(rooms) == []


def test_nothing_under_parallel_imports_the_layers_above():
    bad = {
        (m, t)
        for m, targets in graph().items()
        if m.startswith("plait.parallel")
        for t in targets
        if t.startswith((*ABOVE_PARALLEL, "plait.lessons"))
    }
    assert bad == set()


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for t in edges.get(todo.pop(), ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def forbidden_reach(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(module under parallel/, what it reaches of `NOT_UNDER_PARALLEL`)."""
    return {
        (m, t)
        for m in edges
        if m.startswith("plait.parallel")
        for t in reachable(edges, m)
        if t.startswith(NOT_UNDER_PARALLEL)
    }


def test_nothing_under_parallel_reaches_the_data_or_the_prelaunch_checks():
    assert forbidden_reach(graph()) == set()


def test_pure_parts_import_no_process_group():
    mods = sources()
    bad = {
        (m, name)
        for m, path in mods.items()
        if m.startswith(PURE)
        for name in imports_of(path, set(mods))
        if name.startswith(PROCESS)
    }
    assert bad == set()


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Source lines outside docstrings and comments, where a call could be."""
    tree = ast.parse(path.read_text())
    doc_lines: set[int] = set()
    for node in ast.walk(tree):
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            doc_lines |= set(range(node.lineno, node.end_lineno + 1))
    return [
        (i, line.split("#", 1)[0])
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if i not in doc_lines
    ]


@pytest.mark.parametrize("rule", ["torch.cuda", "collectives"])
def test_device_and_collective_calls_live_in_one_module_each(rule):
    home = {"torch.cuda": "device.py", "collectives": "comm.py"}[rule]
    pattern = (
        re.compile(r"\btorch\.cuda\b|\.cuda\(")
        if rule == "torch.cuda"
        else re.compile(rf"\b(?:dist|torch\.distributed)\.(?:{'|'.join(COLLECTIVES)})\(")
    )
    hits = [
        f"{path.relative_to(SRC)}:{i}"
        for path in sorted(SRC.rglob("*.py"))
        if path.name != home
        for i, line in _code_lines(path)
        if pattern.search(line)
    ]
    assert hits == []


PUBLIC_UNDERSCORED = {"os._exit"}  # Python's documented way to end a process at once


def private_uses(path: Path) -> list[int]:
    """Lines that import from a private torch module (`torch.distributed._shard`) or read a
    private attribute of an object other than `self`/`cls` (`ddp._get_ddp_logging_data`,
    `t._base`, `torch._foreach_norm`): a private torch API, or another plait object's
    insides, which it should make public instead. Type annotations are not uses (nothing
    runs them: `argparse._SubParsersAction` has no public name)."""
    tree = ast.parse(path.read_text())
    annotations = {
        id(inner)
        for node in ast.walk(tree)
        for note in (getattr(node, "annotation", None), getattr(node, "returns", None))
        if note is not None
        for inner in ast.walk(note)
    }
    lines = []
    for node in ast.walk(tree):
        if id(node) in annotations:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            dunder = node.attr.startswith("__") and node.attr.endswith("__")
            if not (mine or dunder or ast.unparse(node) in PUBLIC_UNDERSCORED):
                lines.append(node.lineno)
            continue
        else:
            continue
        parts = [part for name in names if name.startswith("torch") for part in name.split(".")]
        if any(part.startswith("_") and not part.startswith("__") for part in parts):
            lines.append(node.lineno)
    return lines


def test_private_apis_live_in_torch_private_only():
    hits = [
        f"{path.relative_to(SRC)}:{i}"
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "torch_private.py"
        for i in private_uses(path)
    ]
    assert hits == []


def test_the_rules_catch_what_they_forbid(tmp_path):
    """The checks themselves can fail: a circle, a collective, a cuda call and private APIs
    are found."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    chain = {
        "plait.parallel.zero.engine": {"plait.optim"},
        "plait.optim": {"plait.config"},
        "plait.config": {"plait.preflight.corpus"},
        "plait.preflight.corpus": {"plait.data"},
    }
    assert forbidden_reach(chain) == {
        ("plait.parallel.zero.engine", "plait.preflight.corpus"),
        ("plait.parallel.zero.engine", "plait.data"),
    }  # fmt: skip
    assert forbidden_reach(graph() | {"plait.parallel.adamw": {"plait.config"}}) == set()
    bad = tmp_path / "bad.py"
    bad.write_text('"""doc: torch.cuda here is prose."""\nimport torch\ntorch.cuda.synchronize()\n')
    assert [i for i, line in _code_lines(bad) if "torch.cuda" in line] == [3]
    private = tmp_path / "private.py"
    private.write_text(
        "from torch.distributed._shard import sharded_tensor\n"
        "from torch import _C\n"
        "import torch._dynamo\n"
        "base = t._base\n"
        "self._mine, os._exit, type(t).__name__\n"
        "def f(sub: argparse._SubParsersAction) -> x._Y: ...\n"
    )
    assert private_uses(private) == [1, 2, 3, 4]


def readme_layout() -> set[str]:
    """The files README.md's code layout lists under src/plait/, one line each."""
    text = (SRC.parents[1] / "README.md").read_text()
    block = text.split("## Layout of the code", 1)[1].split("```", 2)[1]
    listed, folder = set(), ""
    for line in block.splitlines():
        if not line.startswith("  ") or not line.strip():
            continue
        indent, name = len(line) - len(line.lstrip()), line.split()[0]
        if indent == 2:
            folder, path = (name, None) if name.endswith("/") else ("", name)
        else:
            path = folder + name
        if path:
            listed.add(path)
    return listed


def test_every_file_has_its_line_in_the_readme_layout():
    files = {str(p.relative_to(SRC)) for p in SRC.rglob("*") if p.suffix in (".py", ".toml")}
    listed = readme_layout()
    assert (sorted(files - listed), sorted(listed - files)) == ([], [])
