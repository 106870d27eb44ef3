"""Run a function on N gloo ranks on localhost, with a timeout, and collect what each returns.

Starting ranks costs time (they fork from a server that imported torch and fz once), so tests
batch many checks into one call. A rank that raises fails the call with that rank's traceback;
a hang fails it after `timeout` seconds.
"""
from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any,
            env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's when it started
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        buf = io.BytesIO()
        torch.save(fn(rank, world, *args), buf)  # bytes, not shared memory: the rank exits soon
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure, including DCP's BaseException
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "fz"]
_AT_START = ("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD", "PYTHONMALLOC")  # read once, as a process starts


def _context() -> Any:
    """A fork server that imported torch and fz once: each rank starts as its fork in a fraction of
    a second, where a spawned one imports them again (seconds); it ran no collective and no thread
    of the caller's. Ranks whose environment sets what a process reads only as it starts (malloc's
    tunables) are spawned, so that it takes effect."""
    if any(k.startswith(_AT_START) for k in os.environ):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 180.0) -> list[Any]:
    """fn(rank, world, *args) on `world` fresh processes; returns the results by rank."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    # not daemonic: a rank may start processes of its own (DataLoader workers); `finally` ends them all
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results, env), daemon=False)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:  # a rank died without reporting (killed, or failed to start)
                    raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                       f"before reporting (ranks done: {sorted(out)})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} ranks did not finish within {timeout}s "
                                       f"(ranks done: {sorted(out)})") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}{_the_others(rank, results, procs, out)}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


def _the_others(failed: int, results: Any, procs: list, out: dict, grace: float = 10.0) -> str:
    """What the other ranks did, for a failure's message: a rank that lost its peer ("Connection
    closed by peer") often reports first, while the cause is another rank's own error or its death
    by a signal. Waits up to `grace` seconds for each to report or exit."""
    said: dict[int, str] = {}
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        waiting = [r for r in range(len(procs)) if r != failed and r not in out and r not in said]
        if not waiting:
            break
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            for r in waiting:
                if procs[r].exitcode not in (None, 0):
                    said[r] = f"exited with code {procs[r].exitcode} before reporting"
            continue
        said[rank] = "finished" if ok else f"failed:\n{value}"
    for r in range(len(procs)):
        if r != failed and r not in out and r not in said:
            said[r] = f"still running after {grace:.0f} s"
    return "".join(f"\n\nrank {r} {what}" for r, what in sorted(said.items()))
