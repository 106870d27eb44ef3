"""The package's shape: no import cycle between fz's modules, inside a folder too. Every import
counts: lazy ones inside functions, and those under `if TYPE_CHECKING:` (they never run, but two
files that name each other are one concept split in two: the lower one takes a Protocol of what
it uses instead)."""
from __future__ import annotations

import ast
from pathlib import Path

import fz

ROOT = Path(fz.__file__).parent


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.AST) -> list[str]:
    """The modules an import statement names: `from a.b import c, d` is a.b.c and a.b.d where they
    are modules, else a.b."""
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [f"{node.module}.{a.name}" for a in node.names] + [node.module]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return []


def _graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """{module: the modules it imports} over `sources` ({module: its text})."""
    edges: dict[str, set[str]] = {m: set() for m in sources}
    for m, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            names = _targets(node)
            modules = [t for t in names if t in sources]
            if isinstance(node, ast.ImportFrom) and len(modules) > 1 and names[-1] in modules:
                modules.remove(names[-1])  # names of the package that are its modules: those modules
            edges[m].update(t for t in modules if t != m)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return cycles


def test_the_check_sees_a_circle_through_type_only_and_second_names():
    """Inside one folder, through a TYPE_CHECKING import and the second name of an import."""
    sources = {
        "fz.box": "",
        "fz.box.a": "from fz.box import c, b\n",
        "fz.box.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fz.box.a import A\n",
        "fz.box.c": "",
    }
    assert _cycles(_graph(sources)) == [["fz.box.a", "fz.box.b", "fz.box.a"]]
    sources["fz.box.b"] = ""
    assert _cycles(_graph(sources)) == []


def test_no_import_cycles():
    cycles = _cycles(_graph({_module(p): p.read_text() for p in ROOT.rglob("*.py")}))
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_over_about_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 420}
    assert not long, long
