"""Shared pieces of the benchmarks: the model size, process measurements, and the launcher.

Every engine run is a fresh group of processes (one per rank) started by `launch`; a worker
prints one line `FZBENCH {json}` on rank 0 and `launch` returns that dict (or {'error': ...}).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = "FZBENCH "


# ----------------------------------------------------------------------------- model

def gpt_config(target: int, seq: int, dim: int = 0):
    """gpt_for_params' width (vocab 4096) or `dim`, with the layer count that lands nearest `target`."""
    import torch

    from fz.testing.gpt import GPT, GPTConfig, gpt_for_params

    base = gpt_for_params(target, seq=seq)
    if dim:
        base = GPTConfig(**{**base.__dict__, "dim": dim, "heads": max(1, dim // 64)})

    def count(layers: int) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in GPT(GPTConfig(**{**base.__dict__, "layers": layers})).parameters())

    one, two = count(1), count(2)  # the count is linear in the layers: two models on meta give every other
    per_layer, rest = two - one, 2 * one - two
    layers = min(range(1, 129), key=lambda n: abs(rest + n * per_layer - target))
    return GPTConfig(**{**base.__dict__, "layers": layers}), rest + layers * per_layer


# ----------------------------------------------------------------------------- measurements (in a worker)

def rss_mb(key: str = "VmHWM") -> float:
    """VmHWM (peak) or VmRSS (now) of this process, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB -> MB
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bytes_written() -> int:
    """wchar of this process (all threads): bytes passed to write()-family syscalls.

    gloo's TCP transport sends with writev, so over a step this is what the rank sent
    (checked: a 16 MB all-reduce at world 2 adds 16.0 MB, an all-gather of a 16 MB
    shard 16.0 MB, a reduce-scatter of a 16 MB input 16.0 MB). Nothing else writes
    while a step runs (the workers print only after the last step).
    """
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def tcp_sent_by_peer(pid: int) -> dict[int, int]:
    """{peer pid: bytes this process has sent to it} over its open local TCP connections (`ss -tinp`).

    Engine-agnostic: it counts what gloo really put on each connection, so bytes crossing a
    group boundary can be measured for fz, FSDP2 and DeepSpeed alike."""
    out = subprocess.run(["ss", "-tinpH"], check=False, capture_output=True, text=True, timeout=30).stdout
    conns, owner, head = [], {}, None
    for line in out.splitlines():
        if line.startswith("ESTAB") or (line and not line[0].isspace()):
            parts = line.split()
            if len(parts) < 6 or "pid=" not in line:
                head = None
                continue
            local, peer = parts[3].rsplit(":", 1)[1], parts[4].rsplit(":", 1)[1]
            p = int(line.split("pid=")[1].split(",")[0])
            owner[local] = p
            head = (local, peer, p)
        elif head is not None:
            sent = next((int(t.split(":")[1]) for t in line.split() if t.startswith("bytes_sent:")), 0)
            conns.append((*head, sent))
            head = None
    by_peer: dict[int, int] = {}
    for _local, peer, p, sent in conns:
        if p == pid and peer in owner:
            by_peer[owner[peer]] = by_peer.get(owner[peer], 0) + sent
    return by_peer


def source_hash(root: str | None = None) -> str:
    """Hash of fz/**/*.py (of this checkout or `root`), to catch fz changing in the middle of a run."""
    h = hashlib.sha1()
    for dirpath, dirs, files in sorted(os.walk(os.path.join(root or ROOT, "fz"))):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(dirpath, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:10]


def git_state(root: str | None = None) -> str:
    """HEAD of the repo (this one or `root`) and whether fz/ differs from it (others may edit the working tree)."""
    root = root or ROOT
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], check=False, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "fz"], check=False,
                               capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "git: unknown"
    return f"git {head or '?'}{' + uncommitted fz/ changes' if dirty else ''}, fz/ sources {source_hash(root)}"


def report(result: dict) -> None:
    print(TAG + json.dumps(result), flush=True)


def finish(dist=None) -> None:
    """Leave without interpreter teardown: gloo threads sometimes abort there ("terminate called ...")."""
    if dist is not None and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- launcher

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: Sequence[str], world: int, timeout: float, env: dict[str, str] | None = None) -> dict:
    """Runs `cmd` as `world` fresh ranks (RANK/WORLD_SIZE/MASTER_* set); rank 0's result or {'error': ...}."""
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])), **(env or {})}
    procs, logs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(world):
            out = open(os.path.join(tmp, f"rank{r}.log"), "w+")
            logs.append(out)
            procs.append(subprocess.Popen(list(cmd), env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        deadline, error = time.monotonic() + timeout, None
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                error = f"rank {failed[0]} exited with {procs[failed[0]].returncode}"
                break
            if time.monotonic() > deadline:
                error = f"timeout after {timeout:.0f}s"
                break
            time.sleep(0.1)
        for p in procs:                         # only the ranks started above, by their own group id
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if error is None and failed:
            error = f"rank {failed[0]} exited with {procs[failed[0]].returncode}"
        texts = []
        for out in logs:
            out.seek(0)
            texts.append(out.read())
            out.close()
    result = next((json.loads(ln[len(TAG):]) for ln in texts[0].splitlines() if ln.startswith(TAG)), None)
    if result is not None and error is None:
        return result
    bad = next((t for r, t in enumerate(texts) if procs[r].returncode != 0 and t.strip()), texts[0])
    tail = [ln for ln in bad.strip().splitlines() if ln.strip() and not ln.startswith(TAG)][-4:]
    if result is not None:                      # all steps measured, then a crash or hang at exit
        return {**result, "warning": f"{error} after reporting", "tail": tail}
    return {"error": error or "no result line", "tail": tail}


# ----------------------------------------------------------------------------- reporting

def median(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def paired_ratio(a: list[float | None], b: list[float | None]) -> float | None:
    """Median over repeats of a[r] / b[r], using only repeats where both ran."""
    return median(x / y for x, y in zip(a, b) if x is not None and y)


def load_average() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]], right_from: int = 1) -> str:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- benchmarks/step.py's tables

def summarize(runs, engines, precisions, args):
    """{(engine, precision): row dict}; ratios are medians of per-repeat ratios."""
    w = args.warmup

    def step_s(r):
        return None if "error" in r else median(r["times"][w:])

    rows = {}
    for p in precisions:
        per = {e: [step_s(r) for r in runs[e, p]] for e in engines}
        rss = {e: [None if "error" in r else r["rss_mb"] for r in runs[e, p]] for e in engines}
        for e in engines:
            ok = [r for r in runs[e, p] if "error" not in r]
            if not ok:
                rows[e, p] = {"error": runs[e, p][-1]["error"]}
                continue
            ref = {"fz3": "fsdp2", "fz3-keep": "fsdp2-noreshard"}.get(e.removesuffix("@base"))
            same_ds = "ds" + e[2] if e.startswith("fz") else None
            base = e + "@base"
            row = {"step": median(per[e]), "min": min(x for x in per[e] if x), "max": max(x for x in per[e] if x),
                   "n": len(ok), "warn": sum("warning" in r for r in ok),
                   "rss": median(rss[e]), "base": median(r["base_mb"] for r in ok),
                   "sent": median(median(r["sent"][w:]) for r in ok),
                   "loss": median(r["loss"][-1] for r in ok), "meta": ok[0]}
            row["vs_ddp"] = paired_ratio(per[e], per["ddp"]) if "ddp" in per else None
            row["floor"] = paired_ratio(per["floor"], per[e]) if "floor" in per else None
            row["vs_fsdp2"] = paired_ratio(per[e], per[ref]) if ref in per else None
            row["vs_fsdp2_reshard"] = paired_ratio(per[e], per["fsdp2"]) if "fsdp2" in per else None
            row["vs_ds"] = paired_ratio(per[e], per[same_ds]) if same_ds in per else None
            row["vs_base"] = paired_ratio(per[e], per[base]) if base in per else None
            row["rss_vs_base"] = paired_ratio(rss[e], rss[base]) if base in rss else None
            row["rss_vs_ddp"] = paired_ratio(rss[e], rss["ddp"]) if "ddp" in rss else None
            row["rss_vs_fsdp2"] = paired_ratio(rss[e], rss[ref]) if ref in rss else None
            row["rss_vs_ds"] = paired_ratio(rss[e], rss[same_ds]) if same_ds in rss else None
            if "fz_comm" in ok[0]:
                row["fz_sent"] = ok[0]["fz_comm"]["sent_total"]
                row["fz_state"] = ok[0]["fz_memory"]["total"]
            rows[e, p] = row
    return rows


def table(rows, engines, p) -> str:
    header = ["engine", "step ms", "min-max ms", "vs DDP", "vs FSDP2 / DS same stage", "floor ratio",
              "peak RSS MB/rank", "over base MB", "RSS vs DDP / FSDP2 / DS", "sent MB/step/rank (wchar)",
              "fz comm_report MB", "final loss"]
    out = []
    for e in engines:
        r = rows[e, p]
        if "error" in r:
            out.append([e, f"FAILED: {r['error']}"] + [""] * (len(header) - 2))
            continue
        peer = " FSDP2-noreshard" if e.removesuffix("@base").endswith("-keep") else " FSDP2"
        vs = " / ".join(x for x in [fmt(r["vs_fsdp2"], ".2f", "x" + peer) if r["vs_fsdp2"] else "",
                                    fmt(r["vs_ds"], ".2f", "x DS") if r["vs_ds"] else ""] if x) or "-"
        rv = " / ".join(x for x in [fmt(r["rss_vs_ddp"], ".2f", "x DDP") if e.startswith("fz") else "",
                                    fmt(r["rss_vs_fsdp2"], ".2f", "x" + peer) if r["rss_vs_fsdp2"] else "",
                                    fmt(r["rss_vs_ds"], ".2f", "x DS") if r["rss_vs_ds"] else ""] if x) or "-"
        name = f"{e} (exit error in {r['warn']}/{r['n']})" if r["warn"] else e
        out.append([name, f"{1e3 * r['step']:.1f}", f"{1e3 * r['min']:.0f}-{1e3 * r['max']:.0f}",
                    fmt(r["vs_ddp"], ".2f", "x"), vs, fmt(r["floor"], ".2f"), f"{r['rss']:.0f}",
                    f"{r['rss'] - r['base']:.0f}", rv, f"{r['sent'] / 1e6:.2f}",
                    fmt(r.get("fz_sent") and r["fz_sent"] / 1e6, ".2f"), f"{r['loss']:.4f}"])
    return markdown(header, out)


def base_table(rows, engines, p) -> str | None:
    """Each fz engine against its `@base` twin (another checkout, same repeats): None without a baseline."""
    out = [[e, fmt(rows[e, p].get("vs_base"), ".3f", "x"), fmt(rows[e, p].get("rss_vs_base"), ".3f", "x")]
           for e in engines if e + "@base" in engines and "error" not in rows[e, p]]
    return markdown(["engine", "step vs @base", "peak RSS vs @base"], out) if out else None


def targets(rows, engines, p) -> list:
    """(target, value, met) for the issue's targets, where both sides ran."""
    checks = []

    def get(e, k):
        r = rows.get((e, p))
        return None if r is None or "error" in r else r.get(k)

    def add(what, v, limit, le=True):
        if v is not None:
            checks.append((what, f"{v:.2f}", "met" if (v <= limit if le else v >= limit) else "NOT met"))
    for s in range(3):
        e = f"fz{s}"
        add(f"{e} step <= 1.0x DDP", get(e, "vs_ddp"), 1.0)
        add(f"{e} step <= ds{s}", get(e, "vs_ds"), 1.0)
        add(f"{e} floor ratio >= 0.9", get(e, "floor"), 0.9, le=False)
    add("fz3 step <= 0.85x ds3", get("fz3", "vs_ds"), 0.85)
    add("fz3 step <= 0.7x FSDP2 (reshard)", get("fz3", "vs_fsdp2"), 0.7)
    add("fz3 floor ratio >= 0.8", get("fz3", "floor"), 0.8, le=False)
    add("fz3-keep step <= 0.85x ds3", get("fz3-keep", "vs_ds"), 0.85)
    add("fz3-keep step <= 0.7x FSDP2 (reshard)", get("fz3-keep", "vs_fsdp2_reshard"), 0.7)
    add("fz3-keep step <= 0.7x FSDP2 (no reshard)", get("fz3-keep", "vs_fsdp2"), 0.7)
    add("fz3-keep floor ratio >= 0.8", get("fz3-keep", "floor"), 0.8, le=False)
    add("fz0 peak RSS <= DDP", get("fz0", "rss_vs_ddp"), 1.0)
    for s in (1, 2, 3):
        add(f"fz{s} peak RSS <= 0.85x ds{s}", get(f"fz{s}", "rss_vs_ds"), 0.85)
    add("fz3 peak RSS <= FSDP2 (reshard)", get("fz3", "rss_vs_fsdp2"), 1.0)
    return checks
