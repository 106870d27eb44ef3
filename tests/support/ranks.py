"""One multi-rank run per session, shared by the tests that assert on it.

Spawning ranks costs seconds, so a test module runs one function that makes every check at a
world size, and its tests assert on what each rank returned:

    @pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"world{w}")
    def world_results(request):
        return request.param, cached_runs(request.param, _checks, timeout=400)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fz.testing.spawn import run_ranks

_RUNS: dict[tuple[str, int], list] = {}


def cached_runs(world: int, fn: Callable, *args: Any, timeout: float = 180.0, key: str | None = None) -> list:
    """fn(rank, world, *args) on `world` ranks, once per session per (key, world); the results by rank.

    World 1 calls fn in this process (no spawn); other worlds run it through run_ranks, which
    fails on a rank's exception or after `timeout` seconds. `key` (default: fn's module and
    name) names the run: a later call with the same key and world returns the first call's list
    without looking at its arguments."""
    name = (key or f"{fn.__module__}.{fn.__qualname__}", world)
    if name not in _RUNS:
        _RUNS[name] = [fn(0, 1, *args)] if world == 1 else run_ranks(world, fn, *args, timeout=timeout)
    return _RUNS[name]
