"""Environment every node gets: `.fz_env` / `.deepspeed_env` files and the variables that matter.

As DeepSpeed does with `.deepspeed_env`, each `KEY=VALUE` line (blank lines and `#` comments
are skipped) of the files in the home directory, then in the working directory (which wins), is
exported on every node; `.fz_env` wins over `.deepspeed_env` beside it. The launching shell's
PYTHONPATH, OMP_NUM_THREADS and NCCL_*/GLOO_*/FZ_*/TORCH_*/CUDA_* variables go along too
(DeepSpeed exports NCCL_*, PYTHON*, UCX_*, ...), since a remote shell starts without them.

One default of fz's own, which any of those overrides: THP_MEM_ALLOC_ENABLE=1, torch's switch
for transparent huge pages in its CPU allocator. It must be set before torch starts, so only a
launcher can set it. A CPU step maps its large buffers afresh, page fault by page fault; with
2 MiB pages the NVMe headline's faults per step fell 3.4x and its kernel time 1.7x
(benchmarks/RESULTS.md). With torchrun, export it yourself.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

from fz.errors import ConfigError
from fz.launch.textfile import read_text

log = logging.getLogger(__name__)

ENV_FILES = (".deepspeed_env", ".fz_env")  # later wins
_PASSED = ("PYTHONPATH", "OMP_NUM_THREADS", "MASTER_ADDR", "THP_MEM_ALLOC_ENABLE")
DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}  # torch's CPU allocator: huge pages for buffers of 2 MiB and more
_PREFIXES = ("NCCL_", "GLOO_", "FZ_", "TORCH_", "CUDA_", "UCX_", "HF_")
# a name a node's shell takes as a variable's: the shell line writes it unquoted (`env NAME=value`), so
# one holding `$(...)` would run on every node
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_env(text: str, where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].strip()
        key, eq, value = line.partition("=")
        key = key.strip()
        if not eq or not _NAME.fullmatch(key):
            raise ConfigError(f"{where}, line {n}: {raw.strip()!r} is not KEY=VALUE")
        out[key] = value.strip()
    return out


def env_files(cwd: Path | None = None, home: Path | None = None) -> list[Path]:
    """The env files that exist, lowest precedence first."""
    found = []
    for d in (home or Path.home(), cwd or Path.cwd()):
        for name in ENV_FILES:
            p = d / name
            if p.exists() and p not in found:  # one that is not a regular file is refused, not skipped
                found.append(p)
    return found


def node_env(environ: Mapping[str, str], cwd: Path | None = None, home: Path | None = None) -> dict[str, str]:
    """The variables exported on every node (CUDA_VISIBLE_DEVICES is set per node elsewhere)."""
    out = dict(DEFAULTS)
    for k, v in environ.items():
        if k in _PASSED or k.startswith(_PREFIXES):
            if _NAME.fullmatch(k):
                out[k] = v
            else:
                log.warning("fz run: the variable %r is not passed to the nodes: not a shell variable's name", k[:80])
    out.pop("CUDA_VISIBLE_DEVICES", None)
    for path in env_files(cwd, home):
        out.update(parse_env(read_text(path, "env file"), f"env file {path}"))
    return out

