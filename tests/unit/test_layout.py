"""The package's shape: no import cycle between fz's modules (lazy imports inside functions count;
imports under `if TYPE_CHECKING:` do not: they never run)."""
from __future__ import annotations

import ast
from pathlib import Path

import fz

ROOT = Path(fz.__file__).parent


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph():
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    edges = {m: set() for m in modules}
    for m, p in modules.items():
        tree = ast.parse(p.read_text())
        type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                     and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
                     for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in modules and t != m:
                    edges[m].add(t)
                    break
    return edges


def test_no_import_cycles():
    edges = _graph()
    state, stack, cycles = {}, [], []

    def visit(m):
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
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_over_about_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 420}
    assert not long, long
