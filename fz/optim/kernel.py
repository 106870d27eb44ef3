"""AdamW on host memory with the low-precision parameters written in the same pass.

With fp32 master weights in host memory (the optimizer offloaded, or a CPU-only machine), a
step was torch's fused CPU AdamW over the masters, then a cast copy of the masters into the
bf16 parameters: a second pass that reads every master again from memory. `adamw_` does both
in one pass where it can, through a small C++ kernel (host_adamw.cpp) compiled on first use
against the running torch's own headers and cached; its results are torch's bit for bit (the
same vector operations in the same order, checked against torch when it is loaded). Where it
cannot (no C++ compiler, a CPU torch runs without AVX2, tensors not fp32/bf16 or not in host
memory, `FZ_HOST_KERNEL=0`), the two passes run as before, with the same results.

DeepSpeed builds its CPU Adam the same way (a JIT-compiled op); this kernel needs no ninja and
no Python headers, only `c++` (or `$CXX`). The cache is `$FZ_KERNEL_CACHE`, else
`$XDG_CACHE_HOME/fz/kernels` (~/.cache/fz/kernels), one file per source, torch and CPU kind;
only a folder and files of this user's that no one else can write are used (others could
put code there that fz would load).
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from fz.log import logger

SOURCE = Path(__file__).with_name("host_adamw.cpp")
_FLAGS = {  # torch's own flags for its kernels of each CPU capability (the defines pick at::vec's code)
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2"],
}
_log = logger("fz.optim")
_TEMP = "fz-kernels-"  # a private folder's prefix, where the cache is not one
why_not: str | None = None  # why the kernel is not used here, once `_library` has looked


def compiler() -> str | None:
    """The C++ compiler the kernel is built with: `$CXX`, else `c++` or `g++` on the PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def enabled() -> bool:
    """Whether the one-pass kernel is on (`FZ_HOST_KERNEL=0` turns it off, for comparisons)."""
    return os.environ.get("FZ_HOST_KERNEL", "1") != "0"


def _cache_dir() -> Path:
    if os.environ.get("FZ_KERNEL_CACHE"):
        return Path(os.environ["FZ_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fz" / "kernels"


def _safe(st: os.stat_result) -> bool:
    """Made by this user and writable by no one else: what fz may load code from."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _ours(lib: Path) -> bool:
    """A kernel built here before: a regular file (not a link) that `_safe` allows; else one is built."""
    try:
        st = os.lstat(lib)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and _safe(st)


def _private_cache() -> Path:
    """The cache folder (made private if missing), where it is this user's and no one else can write:
    a library another user could replace would run as this one. Else a private folder of this
    process's (the kernel compiled again, seconds), said once."""
    cache = _cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(cache)
        if stat.S_ISDIR(st.st_mode) and _safe(st):
            return cache
    except OSError:
        pass
    _log.warning("fz: the kernel cache %s is not a folder of this user's that only it can write; the host AdamW "
                 "kernel is compiled into a private temporary folder instead", cache)
    return Path(tempfile.mkdtemp(prefix=_TEMP))


def _command(cxx: str, capability: str, out: str) -> list[str]:
    root = Path(torch.__file__).parent
    abi = int(torch.compiled_with_cxx11_abi())
    return [cxx, "-O2", "-std=c++17", "-fPIC", "-shared", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *_FLAGS[capability], "-I", str(root / "include"), str(SOURCE), "-o", out,
            "-L", str(root / "lib"), "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{root / 'lib'}"]


def _build(cxx: str, capability: str) -> Path:
    """The kernel's shared library, compiled once per (source, torch and its place, capability, compiler)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), torch.__version__, capability, version,
                                    " ".join(_command(cxx, capability, ""))]).encode()).hexdigest()[:16]
    cache = _private_cache()
    lib = cache / f"host_adamw-{capability.lower()}-{key}.so"
    if _ours(lib):
        return lib
    lock = os.open(cache / ".lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with open(lock, "w") as held:  # ranks starting together compile once
        fcntl.flock(held, fcntl.LOCK_EX)
        if not _ours(lib):
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            try:
                done = subprocess.run(_command(cxx, capability, tmp), capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise RuntimeError(done.stderr.strip()[-2000:] or f"{cxx} exited with {done.returncode}")
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    return lib


_BUILDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fz-kernel-build")
_READY: Future | None = None  # the build `prepare` started


def prepare() -> None:
    """Start building and loading the kernel in the background: fz.init calls it where the update
    will run on the host, so its compile (seconds) overlaps the init instead of the first step."""
    global _READY
    if _READY is None and enabled():
        _READY = _BUILDER.submit(_load)


def _library() -> tuple[ctypes.CDLL, int] | None:
    """(the loaded kernel, its vector size), or None where it cannot run here (`why_not` says why)."""
    if _READY is not None:
        return _READY.result()
    return _load()


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL, int] | None:
    global why_not
    capability = torch.backends.cpu.get_cpu_capability()
    cxx = compiler()
    if capability not in _FLAGS or cxx is None or not torch.backends.openmp.is_available():
        why_not = f"CPU capability {capability}, compiler {cxx}, OpenMP {torch.backends.openmp.is_available()}"
        _log.debug("fz: host AdamW casts in a second pass (%s)", why_not)
        return None
    try:
        built = _build(cxx, capability)
        lib = ctypes.CDLL(str(built))
        if built.parent.name.startswith(_TEMP):  # a private folder of this process's: loaded, not needed again
            shutil.rmtree(built.parent, ignore_errors=True)
        lib.fz_adamw_bf16.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_double] * 7
        lib.fz_adamw_bf16.restype = None
        found = (lib, int(lib.fz_vec_size()))
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:  # AttributeError: a symbol missing
        why_not = f"did not build: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
        _log.warning("fz: the one-pass host AdamW kernel %s; the update casts the parameters in a second pass "
                     "(same results, slower)", why_not)
        return None
    if not _agrees(found):
        why_not = "disagrees with torch"
        _log.warning("fz: the one-pass host AdamW kernel's results differ from torch's fused AdamW here; it is "
                     "not used (the update casts in a second pass, with torch's results)")
        return None
    return found


def adamw_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
           exp_avg_sqs: Sequence[Tensor], step: Tensor, *, lr: float, beta1: float, beta2: float,
           weight_decay: float, eps: float, cast: Sequence[Tensor | None] | None = None,
           grad_mul: Tensor | None = None) -> None:
    """`torch._foreach_mul_(grads, grad_mul)` (the clip's factor, a 0-d fp32 tensor; None: none), then
    torch._fused_adamw_ over the lists (in place), then each `params[i]` cast into `cast[i]` (None:
    not cast): in one pass where the kernel runs, else torch's kernels and a cast copy. The
    gradients are the caller's to drop: what they hold afterwards is not defined."""
    cast = list(cast) if cast is not None else [None] * len(params)
    wanted = enabled() and any(c is not None and _fits(c, p) for c, p in zip(cast, params))
    _run(_library() if wanted else None, params, grads, exp_avgs, exp_avg_sqs, step, cast,
         dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps), grad_mul)


def _run(found: tuple[ctypes.CDLL, int] | None, params: Sequence[Tensor], grads: Sequence[Tensor],
         exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor], step: Tensor, cast: list[Tensor | None],
         hyper: dict[str, float], grad_mul: Tensor | None = None) -> None:
    rest: list[tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]] = []
    count = float(step.item()) if found is not None else 0.0  # torch's kernel reads the step as a float
    mul = float(grad_mul.item()) if found is not None and grad_mul is not None else 1.0  # an fp32 value, exact
    for p, g, m, v, c in zip(params, grads, exp_avgs, exp_avg_sqs, cast):
        if found is None or c is None or not _fits(c, p, g, m, v):
            rest.append((p, g, m, v, c))
            continue
        lib, width = found
        n = p.numel()
        whole = n - n % width
        lib.fz_adamw_bf16(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), c.data_ptr(), whole,
                          hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["weight_decay"], hyper["eps"], count,
                          mul)
        if whole < n:  # the last partial vector: torch's scalar code, as in its own call
            tail = [t.view(-1)[whole:] for t in (p, g, m, v, c)]
            rest.append((tail[0], tail[1], tail[2], tail[3], tail[4]))
    if rest:
        ps, gs, ms, vs, cs = (list(x) for x in zip(*rest))
        if grad_mul is not None:
            torch._foreach_mul_(gs, grad_mul)
        torch._fused_adamw_(ps, gs, ms, vs, [], [step] * len(ps), lr=hyper["lr"], beta1=hyper["beta1"],
                            beta2=hyper["beta2"], weight_decay=hyper["weight_decay"], eps=hyper["eps"],
                            amsgrad=False, maximize=False)
        pairs = [(c, p) for p, c in zip(ps, cs) if c is not None]
        if pairs:
            torch._foreach_copy_([c for c, _ in pairs], [p for _, p in pairs])


def _fits(out: Tensor, *tensors: Tensor) -> bool:
    """Whether the kernel takes these: fp32 in, bf16 out, contiguous, in host memory, one size."""
    return (out.dtype == torch.bfloat16 and out.device.type == "cpu" and out.is_contiguous()
            and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                    and t.numel() == out.numel() for t in tensors))


def _agrees(found: tuple[ctypes.CDLL, int]) -> bool:
    """The kernel against torch's fused AdamW and cast on random values (tails, decay and none,
    both lerp branches, a clip's factor and none, three steps): every bit of masters, moments and
    bf16 parameters equal."""
    lib, width = found
    gen = torch.Generator().manual_seed(0)
    n = 64 * width + width // 2 + 1
    for beta1, beta2, decay, mul in ((0.9, 0.999, 0.01, None), (0.3, 0.95, 0.0, 0.3718)):
        p = torch.randn(n, generator=gen) * torch.logspace(-20, 6, n)
        ref = [p, torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)]
        got = [t.clone() for t in ref]
        for count in (1.0, 2.0, 3.0):
            g = torch.randn(n, generator=gen) * torch.logspace(-12, 2, n)
            step = torch.tensor(count)
            hyper = dict(lr=1e-3, beta1=beta1, beta2=beta2, weight_decay=decay, eps=1e-8)
            factor = None if mul is None else torch.tensor(mul)
            _run(None, [ref[0]], [g.clone()], [ref[1]], [ref[2]], step, [ref[3]], hyper, factor)
            _run(found, [got[0]], [g], [got[1]], [got[2]], step, [got[3]], hyper, factor)
        if not all(torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))
                   for a, b in zip(ref, got)):
            return False
    return True
