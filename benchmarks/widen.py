"""Where offloaded gradients are widened to fp32: the host's cost of doing it, measured.

With the optimizer state on the host, each reduced gradient crosses down in the dtype it was
reduced in and the host widens it into its fp32 buffer (fz/offload/host_grads.py): bf16 at
one rank (or with reduce_dtype="bf16"), 2 bytes an element on the bus. Widening on the device
instead sends 4 and spares the host that pass (the fp32 copy lands in the pinned buffer the
update reads: no host pass at all). This measures the host's side on this machine: each
operation HostGrads runs per bucket, on a reused (faulted-in) buffer, median of `--repeats`:

    widen   fp32 <- bf16  (copy_: the first micro-batch of a bf16 gradient, what fz does)
    copy    fp32 <- fp32  (copy_: what landing an fp32 copy would cost if it needed a pass)
    add     fp32 += bf16 / fp32 += fp32  (the later micro-batches, either way): torch's mixed-dtype
            add, and fz's (HostGrads._add: widened a chunk at a time into a scratch, then added)

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/widen.py --elements 10e6 50e6 --threads 1 2

The bus's side needs a GPU (the extra 2 bytes an element at its host<->device bandwidth).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from fz.offload.host_grads import HostGrads
from fz.offload.transfer import PinnedPool

log = logging.getLogger("fz.benchmarks.widen")


def _time(fn, repeats: int) -> float:
    fn()  # warm: pages faulted in, threads up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(n: int, threads: int, repeats: int) -> dict[str, float]:
    """{operation: ns an element} for an `n`-element bucket with `threads` intra-op threads."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(n, generator=g)
    narrow = wide.to(torch.bfloat16)
    acc = torch.empty(n).copy_(wide)
    host = HostGrads(PinnedPool(pin=False, max_bytes=None), torch.device("cpu"))
    ops = {
        "widen fp32<-bf16": lambda: acc.copy_(narrow),
        "copy fp32<-fp32": lambda: acc.copy_(wide),
        "add fp32+=bf16": lambda: acc.add_(narrow),
        "add fp32+=bf16 (fz)": lambda: host._add(acc, narrow),
        "add fp32+=fp32": lambda: acc.add_(wide),
    }
    return {k: _time(fn, repeats) / n * 1e9 for k, fn in ops.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--elements", type=float, nargs="+", default=[10e6, 50e6])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info("| elements | threads | operation | ns/element | GB/s of host memory traffic |")
    log.info("|---|---|---|---|---|")
    traffic = {"widen fp32<-bf16": 6, "copy fp32<-fp32": 8, "add fp32+=bf16": 10, "add fp32+=bf16 (fz)": 10,
               "add fp32+=fp32": 12}  # bytes read and written an element
    for n in a.elements:
        for t in a.threads:
            for op, ns in measure(int(n), t, a.repeats).items():
                log.info(f"| {n:.0e} | {t} | {op} | {ns:.3f} | {traffic[op] / ns:.1f} |")


if __name__ == "__main__":
    main()
