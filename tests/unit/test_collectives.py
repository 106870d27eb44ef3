"""Every collective fz runs is waited by fz (issue 40), read from the sources: a lost rank is then
an fz.PeerError within Spec.timeout_s, never gloo's raw "Connection reset by peer" or a hang.

- a torch.distributed collective is launched with `async_op=True` (isend/irecv always are) and
  handed straight to a settle.Handle (`.add(...)`) or to `peers.wait_work` (shm's `_wait`);
- a process group is created only inside `startup.watched(...)`, which watches the other ranks'
  heartbeats and the store while it starts (fz.init's own start-up, a mesh's groups, the
  checkpoint groups); the exceptions are one-process groups and the test launcher's.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

FZ = Path(__file__).resolve().parents[2] / "fz"

COLLECTIVES = {"all_reduce", "broadcast", "barrier", "all_gather", "all_gather_single", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "monitored_barrier",
               "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
               "all_reduce_coalesced", "batch_isend_irecv"}
COMPAT = {"all_gather_single", "reduce_scatter_single"}  # fz.compat's, called by their bare names
GROUPS = {"init_process_group", "new_group", "new_subgroups", "split_group", "init_device_mesh"}
WAITERS = {"add", "wait_work", "_wait"}  # settle.Handle.add, peers.wait_work, shm's _wait
UNWATCHED = {  # groups of one process, or the test launcher's own group
    ("fz/distributed/group.py", "init_process_group"),  # fz's one-process group (a HashStore)
    ("fz/distributed/startup.py", "init_process_group"),  # WORLD_SIZE=1: nobody to wait for
    ("fz/sharding/mesh.py", "init_device_mesh"),  # world 1 (the other call is watched)
    ("fz/testing/spawn.py", "init_process_group"),  # the test launcher's group, not fz's
}


def _name(call: ast.Call, imported: set[str]) -> str | None:
    """The torch.distributed function `call` calls (`dist.x`, `torch.distributed.x`, an imported x)."""
    f = call.func
    if isinstance(f, ast.Attribute) and (
            (isinstance(f.value, ast.Name) and f.value.id == "dist")
            or (isinstance(f.value, ast.Attribute) and f.value.attr == "distributed")):
        return f.attr
    if isinstance(f, ast.Name) and f.id in imported:
        return f.id
    return None


def _called(node: ast.AST) -> str | None:
    f = node.func if isinstance(node, ast.Call) else None
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _findings() -> list[str]:
    bad = []
    for path in sorted(FZ.rglob("*.py")):
        rel = str(path.relative_to(FZ.parent))
        tree = ast.parse(path.read_text())
        parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.module in ("torch.distributed", "torch.distributed.device_mesh", "fz.compat")
                    for a in node.names} & (COLLECTIVES | GROUPS)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or (name := _name(node, imported)) is None:
                continue
            where = f"{rel}:{node.lineno}: {name}"
            if name in COLLECTIVES or name in COMPAT:
                asynchronous = name in ("isend", "irecv") or any(
                    k.arg == "async_op" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords)
                if not asynchronous:
                    bad.append(f"{where} blocks in torch (no async_op=True): no deadline of fz's, no PeerError")
                elif _called(parent[node]) not in WAITERS:
                    bad.append(f"{where}: its work is not handed to a settle.Handle or peers.wait_work")
            elif name in GROUPS and (rel, name) not in UNWATCHED:
                up = parent.get(node)
                while up is not None and not (isinstance(up, ast.Lambda) and _called(parent.get(up)) == "watched"):
                    up = parent.get(up)
                if up is None:
                    bad.append(f"{where} is not started inside startup.watched(lambda: ...)")
    return bad


def test_every_collective_and_group_start_is_waited_by_fz():
    bad = _findings()
    assert not bad, "collectives outside fz's deadline and PeerError:\n" + "\n".join(bad)


def test_the_check_sees_a_blocking_collective(tmp_path, monkeypatch):
    """The check itself can fail: a plain all_reduce and an unwatched new_group are found."""
    (tmp_path / "fz").mkdir()
    (tmp_path / "fz" / "bad.py").write_text("import torch.distributed as dist\n"
                                            "dist.all_reduce(t)\n"
                                            "h = dist.all_reduce(t, async_op=True)\n"
                                            "g = dist.new_group([0, 1])\n")
    monkeypatch.setattr(sys.modules[__name__], "FZ", tmp_path / "fz")
    found = _findings()
    assert len(found) == 3 and "no async_op=True" in found[0] and "not handed" in found[1], found
    assert "startup.watched" in found[2], found
