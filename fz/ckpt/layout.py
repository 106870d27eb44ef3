"""The on-disk layout of a checkpoint root, and the durable file operations the commit uses.

    <root>/step_<N>/        a committed checkpoint (renamed from step_<N>.tmp when complete)
    <root>/step_<N>.tmp/    being written; never read
    <root>/step_<N>.del/    being pruned; never read
    <root>/step_<N>.old/    the committed copy a save of step N again set aside (fz/ckpt/commit.py):
                            read while step_<N> is missing or `latest`'s checksum is this copy's
    <root>/latest           "step_<N> manifest-crc32=<8 hex>": the newest committed checkpoint and
                            the crc32 of its manifest.json (replaced atomically); a `latest` that
                            holds only "step_<N>" (an older fz's) is read too

A crash at any moment leaves `latest` naming a complete directory, because a directory is
renamed into place only after every file in it is fsynced, and `latest` is replaced (write
`latest.tmp`, fsync, rename, fsync the root) only after that rename is durable.

fz.deepspeed's `save_checkpoint` writes DeepSpeed's layout instead: `<save_dir>/<tag>/` is the
checkpoint (the same files as a step_<N>), and `<save_dir>/latest` holds the tag alone, as
DeepSpeed's does; `resolve` reads both, and the older `<save_dir>/<tag>/step_<N>/`.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any

from fz.ckpt.regular import inside, parse_json, plain_name, read_regular, read_small
from fz.errors import CheckpointError, ConfigError

PathLike = str | os.PathLike
LATEST = "latest"
MANIFEST = "manifest.json"
META = "fz.json"
OLD = ".old"  # a committed copy set aside while a save replaces it (fz/ckpt/commit.py)
_STEP_RE = re.compile(r"^step_(\d+)$")
_COPY_RE = re.compile(r"^step_(\d+)(?:\.old)?$")
_LATEST_RE = re.compile(r"^(step_\d+)(?: manifest-crc32=([0-9a-f]{8}))?$")
LOW_FREE = 64 << 20  # bytes: a write that fails with less than this free is blamed on a full disk


def step_name(step: int) -> str:
    return f"step_{step}"


def fsync_path(path: PathLike) -> None:
    """fsync a file or a directory (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write and fsync one file (the caller fsyncs the directory); a symlink at `path` is not
    followed (the open fails: a save never writes where a planted link leads)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_durable(path: Path, data: bytes) -> None:
    """Atomically replace `path` with `data`: write a sibling .tmp (whatever had that name, a link
    too, removed first, never followed), fsync, rename, fsync the dir."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    write_durable(tmp, data)
    os.replace(tmp, path)
    fsync_path(path.parent)


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file (of the folder it is in: a symlink out of it is refused); missing,
    unreadable, not a regular file, nested too deep or unparsable is a CheckpointError naming it."""
    try:
        return parse_json(read_regular(inside(path.parent, path)), f"checkpoint file {path}")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except CheckpointError:
        raise
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} is unreadable ({type(e).__name__}: {e})") from None


def _no_space(err: BaseException) -> bool:
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: exception}
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        stack += [e.__cause__, e.__context__]
    return False


def disk_full(path: PathLike, err: BaseException) -> ConfigError | None:
    """The error to raise instead of `err`, a failed write to `path`, when the disk is full: a
    full disk surfaces as many errors (torch.save's "unexpected pos 704 vs 598", ENOSPC, ...),
    so the free space is checked when a write fails. None when there is room."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return None
    if usage.free >= LOW_FREE and not _no_space(err):
        return None
    cause = str(err) if isinstance(err, ConfigError) else f"writing {path} failed: {type(err).__name__}: {err}"
    return CheckpointError(f"the disk is full ({usage.free / 2**20:.1f} MiB free of {usage.total / 2**30:.1f} GiB on "
                       f"the filesystem holding {probe}): {cause}")


def manifest_crc(step_dir: Path) -> str | None:
    """crc32 of a step's manifest.json (what `latest` records), None when it is missing; one that
    is not a regular file inside the step's folder is refused unread."""
    path = step_dir / MANIFEST
    try:
        return f"{zlib.crc32(read_regular(inside(step_dir, path), 'the manifest')):08x}"
    except FileNotFoundError:
        return None


def write_latest(root: Path, name: str) -> None:
    """Point `latest` at the committed step `name`, with its manifest's crc (atomically)."""
    crc = manifest_crc(root / name)
    replace_durable(root / LATEST, (name + (f" manifest-crc32={crc}" if crc else "") + "\n").encode())


def current(root: Path, name: str, want: str | None = None) -> Path:
    """The directory to read for the committed checkpoint `name` of `root`: `root/name`, or the
    copy a save of the same name set aside (`name.old`) while `root/name` is missing or while
    `want`, the manifest checksum `latest` records, is that copy's (fz/ckpt/commit.py). Either
    must lie inside `root`: a symlink out of it (a downloaded checkpoint's) is refused."""
    final, old = root / name, root / (name + OLD)
    inside(root, final, "checkpoint step folder")
    if not old.is_dir():
        return final
    inside(root, old, "checkpoint step folder")
    if not final.exists():
        return old
    if want is not None and manifest_crc(final) != want and manifest_crc(old) == want:
        return old
    return final


def read_latest(root: Path) -> str | None:
    """The step `latest` names; a CheckpointError when it does not match the step's manifest."""
    entry = pointer(root)
    return None if entry is None else entry[0]


def pointer(root: Path) -> tuple[str, str | None] | None:
    """(the step `latest` names, the manifest checksum it records or None), checked against the
    step's manifest; None without a `latest`."""
    if not (root / LATEST).exists() and not (root / LATEST).is_symlink():
        return None
    raw = read_small(inside(root, root / LATEST, "the checkpoint pointer"), 4096, "the checkpoint pointer")
    text = raw.decode("utf-8", "replace").strip()
    m = _LATEST_RE.match(text)
    if m is None:
        raise CheckpointError(f"{root / LATEST} is corrupted: it holds {text[:60]!r}, not 'step_<N> "
                              f"manifest-crc32=<crc>'; restore a step explicitly (step=N; committed steps: "
                              f"{committed_steps(root) or 'none'})")
    name, want = m.group(1), m.group(2)
    if want is None:  # the old format: the name only
        return name, None
    got = manifest_crc(current(root, name, want))
    if got == want:
        return name, want
    match = [s for s in committed_steps(root)
             if step_name(s) != name and manifest_crc(current(root, step_name(s))) == want]
    if match:
        raise CheckpointError(
            f"{root / LATEST} says {name}, but the manifest checksum it records ({want}) is {step_name(match[0])}'s: "
            f"it should say {step_name(match[0])} (the file was edited or damaged). Restore a step explicitly "
            f"(step={match[0]}, or step={name.split('_', 1)[1]} for the one it names; `fz inspect --step N`), or "
            f"write '{step_name(match[0])}' into {root / LATEST}")
    if got is None and not current(root, name).exists():
        return name, want  # resolve() names the missing directory
    raise CheckpointError(
        f"{root / LATEST} says {name}, but it records manifest checksum {want} and {name}'s manifest has "
        f"{got or 'none'}; no committed step has {want} (the file or {name} was changed). Restore a step "
        f"explicitly (step=N; committed steps: {committed_steps(root) or 'none'}), or write the step to "
        f"restore into {root / LATEST}")


def _tag_folder(root: Path) -> Path | None:
    """The folder a DeepSpeed-style `latest` (the tag alone, as fz.deepspeed's save_checkpoint
    writes it) names in `root`, when that folder holds an fz checkpoint; else None."""
    if not (root / LATEST).is_file():
        return None
    raw = read_small(inside(root, root / LATEST, "the checkpoint pointer"), 4096, "the checkpoint pointer")
    tag = raw.decode("utf-8", "replace").strip()
    if not plain_name(tag) or _LATEST_RE.match(tag):  # fz's own `latest`, or not a name: pointer() says which
        return None
    d = current(root, tag)
    return d if (d / MANIFEST).is_file() or (d / LATEST).is_file() else None


def committed_steps(root: Path) -> list[int]:
    """Steps with a committed directory (a name without .tmp/.del and a manifest, or the copy a
    replacing save set aside), ascending."""
    if not root.is_dir():
        return []
    out = set()
    for p in root.iterdir():
        m = _COPY_RE.match(p.name)
        if m and (p / MANIFEST).is_file():
            out.add(int(m.group(1)))
    return sorted(out)


def resolve(path: PathLike, step: int | None = None) -> Path:
    """The checkpoint directory to read: `step_<step>`, else what `latest` names, else the newest.

    `path` may also be a step directory itself, or a DeepSpeed save_dir or tag folder that
    fz.deepspeed wrote. A name a save is replacing reads as its set-aside copy (`current`).
    """
    root = Path(path)
    aside = root.with_name(root.name + OLD) if root.name else root
    if step is None and not root.exists() and aside.is_dir():
        return resolve(aside)  # a save is replacing this folder, or one was cut off doing so
    if step is None and _STEP_RE.match(root.name) and not root.exists():
        have = committed_steps(root.parent)
        raise CheckpointError(f"no checkpoint {root}: there is no step {root.name.split('_', 1)[1]} in {root.parent} "
                              f"(committed steps: {have or 'none'})")
    if step is None and (_STEP_RE.match(root.name) or any((root / n).exists() for n in (MANIFEST, META, ".metadata"))):
        return root  # a step directory itself
    if step is not None:
        d = current(root, step_name(int(step)))
        if not d.is_dir():
            have = committed_steps(root)
            raise CheckpointError(f"no checkpoint for step {step} in {root} (committed steps: {have or 'none'})")
        return d
    tagged = _tag_folder(root)
    if tagged is not None:
        return resolve(tagged)  # fz.deepspeed's save_dir: `latest` holds a tag
    entry = pointer(root)
    if entry is not None:
        d = current(root, *entry)
        if not d.is_dir():
            raise CheckpointError(f"{root / LATEST} names {entry[0]}, which does not exist")
        return d
    steps = committed_steps(root)
    if not steps:
        what = "does not exist" if not root.exists() else "holds no committed checkpoint"
        partial = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
        extra = f" (incomplete: {', '.join(partial[:5])})" if partial else ""
        inside = _checkpoints_inside(root) if root.is_dir() and not partial else []
        if inside:  # a Trainer's checkpoint-N/ holds fz's checkpoint in its fz/
            extra += f"; a checkpoint is inside it: pass {' or '.join(str(p) for p in inside[:3])}"
        raise CheckpointError(f"checkpoint path {root} {what}{extra}")
    return current(root, step_name(steps[-1]))


def _checkpoints_inside(root: Path, look: int = 200) -> list[Path]:
    """The folders right inside `root` (of its first `look` entries) that hold a checkpoint."""
    found = []
    try:
        for i, p in enumerate(root.iterdir()):
            if i >= look:
                break
            if p.is_dir() and not p.is_symlink() and (committed_steps(p) or
                                                      any((p / n).exists() for n in (LATEST, MANIFEST, META))):
                found.append(p)
    except OSError:  # unreadable: the error it would have added to is said without it
        return []
    return sorted(found)


def clean_stale(root: Path) -> None:
    """Remove leftovers of crashed saves and prunes (*.tmp, *.del); rank 0 only, before a save.
    One that is not a folder, a file or a symlink (never followed: what it points to is not the
    checkpoint's), is unlinked too: left there, it made every save of that step fail."""
    for p in root.iterdir():
        if p.name.endswith((".tmp", ".del")) and p.name.startswith("step_"):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        elif p.name == LATEST + ".tmp":
            p.unlink(missing_ok=True)


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` committed steps, never the one `latest` names.

    Each is renamed to .del first, so a crash mid-delete never leaves a half-deleted
    directory under a committed name.
    """
    latest = read_latest(root)
    steps = committed_steps(root)
    for s in steps[:max(0, len(steps) - keep_last)]:
        if step_name(s) == latest:
            continue
        dead = root / (step_name(s) + ".del")
        os.replace(root / step_name(s), dead)
        fsync_path(root)
        shutil.rmtree(dead, ignore_errors=True)

