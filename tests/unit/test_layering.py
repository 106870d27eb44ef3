"""fz's packages import only downward: storage, distributed, sharding, offload, config, state,
step, ckpt, the API (the brief's layering). Read from the sources (imports inside functions
count too), so a back-up import fails here before it becomes a cycle."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

FZ = Path(__file__).resolve().parents[2] / "fz"

LAYERS = [  # lowest first; a package may import its own layer and those below
    {"errors", "compat", "version", "precision", "rng", "background", "log"},
    {"storage"},  # file-backed tensors, their store and I/O pool
    {"distributed"},  # process-group start, peers (deadlines, lost ranks), arrival
    {"optim", "model"},
    {"sharding"},
    {"offload"},  # policies: state -> state, host gradients, transfers
    {"spec", "config"},  # the Spec and what reads DeepSpeed configs into one
    {"state"},
    {"step"},
    {"ckpt", "observe", "data"},
    {"planning", "launch", "init_state"},
    {"__init__", "__main__", "cli", "testing"},  # the API
    {"hf", "deepspeed"},  # the compatibility shells: Hugging Face's Trainer, DeepSpeed's engine
]
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports() -> dict[str, set[tuple[str, str, int]]]:
    """{fz package: {(imported fz package, file, line)}} over every import statement."""
    out: dict[str, set] = defaultdict(set)
    for path in FZ.rglob("*.py"):
        rel = path.relative_to(FZ.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        here = "__init__" if module == "fz" else _package(module)
        package = module if rel.name == "__init__" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [base + "." + a.name if base == "fz" else base for a in node.names]
            for name in names:
                if name == "fz" or name.startswith("fz."):
                    target = _package(name)
                    if target != here:
                        out[here].add((target, str(path.relative_to(FZ.parent)), node.lineno))
    return out


def test_every_package_has_a_layer():
    found = {p.name for p in FZ.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    found |= {p.stem for p in FZ.glob("*.py")}
    assert found <= set(LAYER), sorted(found - set(LAYER))


def test_imports_run_only_downward():
    up = [f"{file}:{line}: {pkg} imports {target}" for pkg, edges in _imports().items()
          for target, file, line in edges if LAYER[target] > LAYER[pkg]]
    assert not up, "imports running back up:\n" + "\n".join(sorted(up))


def test_no_cycles_between_packages():
    graph = {pkg: {t for t, _, _ in edges} for pkg, edges in _imports().items()}
    cycles = []

    def visit(node, path):
        for nxt in graph.get(node, ()):
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif len(path) < len(LAYER):
                visit(nxt, path + [nxt])

    for start in graph:
        visit(start, [start])
    assert not cycles, cycles[:5]


CKPT_LAYERS = [  # inside fz/ckpt, lowest first; every other module of fz/ckpt (fz's own format, the API) is above
    {"regular", "signing", "layout", "finite", "progress", "results"},  # what every format shares
    {"hf"},  # Hugging Face's files: safetensors, from_pretrained folders
    {"deepspeed"},  # DeepSpeed's checkpoints: read with hf's bounded reads, consolidated with its safetensors writer
]
CKPT_LAYER = {part: i for i, layer in enumerate(CKPT_LAYERS) for part in layer}


def _ckpt_part(module: str) -> str:
    """fz.ckpt.hf.folder -> hf; fz.ckpt.saver -> saver; fz.ckpt -> __init__."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def test_checkpoint_formats_import_only_downward():
    """fz/ckpt/'s base, then fz/ckpt/hf/, then fz/ckpt/deepspeed/, then fz's own checkpoints."""
    top = len(CKPT_LAYERS)
    up = []
    for path in (FZ / "ckpt").rglob("*.py"):
        rel = path.relative_to(FZ.parent).with_suffix("")
        here = _ckpt_part(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "fz.ckpt":
                names = [f"fz.ckpt.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                target = _ckpt_part(name) if name.startswith("fz.ckpt.") else None
                if target and target != here and CKPT_LAYER.get(target, top) > CKPT_LAYER.get(here, top):
                    up.append(f"{path.relative_to(FZ.parent)}:{node.lineno}: {here} imports {target}")
    assert not up, "imports running back up inside fz/ckpt:\n" + "\n".join(sorted(up))
