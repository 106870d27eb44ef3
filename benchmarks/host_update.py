"""The host update: fz's optimizer step on an offloaded shard against DeepSpeed's CPU Adam.

With the optimizer on the host (fz.offload.cpu) and bf16 parameters over fp32 masters, fz's step
updates each bucket's shard with `fz.optim.adamw(...).step(grads, state, masters, donate=True,
cast=bf16 params)` (fz/step/updaters.py: host_casts): AdamW with weight decay, the masters and
moments in place, the bf16 parameters written in the same pass where fz's kernel builds
(fz/optim/kernel.py). DeepSpeed's ZeRO-Offload runs `DeepSpeedCPUAdam.step()` on the fp32
partition and then copies it into the bf16 parameters (`bit16.copy_(fp32)`); its op (0.19)
writes no bf16 itself. Four engines, on the same buffers, one shard per size:

    fz        fz's update as the step runs it
    fz-2pass  the same with FZ_HOST_KERNEL=0: torch's fused AdamW, then the cast (fz before the kernel)
    ds        DeepSpeedCPUAdam.step(), fp32 only
    ds+cast   DeepSpeedCPUAdam.step() and the cast into bf16: DeepSpeed's update of the same shard

Every (size, threads) pair is timed in each round, the engines in a rotating order; DeepSpeed's
op is built (JIT) before any timing. Elements/s = shard size / median seconds of one update;
the ratios are medians of per-round ratios. Needs DeepSpeed:

    OMP_NUM_THREADS=2 ../venv-ds/bin/python benchmarks/host_update.py --sizes 10e6,100e6,400e6 --threads 1,2

Before timing, fz's update is checked bit for bit against fz's reference on the same inputs
(torch._fused_adamw_ then the cast copy: what fz computed before the kernel), three steps on a
shard of --check-numel elements; DeepSpeed's result is compared too, for information only (its
arithmetic differs: float bias corrections, the decay applied as p += -lr*wd*p, eps added to
sqrt(v) * (1/sqrt(bc2)): a few ulps apart).
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import git_state, load_average, markdown  # noqa: E402

ENGINES = ["fz", "fz-2pass", "ds", "ds+cast"]
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
log = logging.getLogger("host_update")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="10e6,100e6,400e6", help="shard sizes in elements")
    p.add_argument("--threads", default="1,2", help="torch.set_num_threads values (DeepSpeed's op shares its OpenMP)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--check-numel", type=int, default=10_000_007, help="shard of the bit-for-bit check")
    return p.parse_args()


class Shard:
    """One shard's buffers (fp32 master, gradient, moments; bf16 parameters), shared by the engines."""

    def __init__(self, n: int, seed: int = 0):
        import torch
        gen = torch.Generator().manual_seed(seed)
        self.n = n
        self.p = torch.randn(n, generator=gen)
        self.g = torch.randn(n, generator=gen) * 1e-3
        self.m, self.v = torch.zeros(n), torch.zeros(n)
        self.low = self.p.to(torch.bfloat16)

    def fz(self):
        """fz's update of this shard, as a function of no arguments (its state carried along)."""
        import fz
        opt = fz.optim.adamw(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        s = opt.init({"w": self.p[:1]})
        state = [(s[0]._replace(mu={"w": self.m}, nu={"w": self.v}), s[1], s[2])]
        grads, params, cast = {"w": self.g}, {"w": self.p}, {"w": self.low}

        def step():
            state[0] = opt.step(grads, state[0], params, donate=True, cast=cast)
        return step

    def ds(self, cast: bool):
        import torch
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        p = torch.nn.Parameter(self.p)  # the same storage
        p.grad = self.g
        opt = DeepSpeedCPUAdam([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        opt.state[p] = {"step": 0, "exp_avg": self.m, "exp_avg_sq": self.v}

        def step():
            opt.step()
            if cast:
                self.low.copy_(self.p)
        return step


def two_pass(step):
    def run():
        os.environ["FZ_HOST_KERNEL"] = "0"
        try:
            step()
        finally:
            del os.environ["FZ_HOST_KERNEL"]
    return run


def engines(shard: Shard) -> dict:
    fz_step = shard.fz()
    return {"fz": fz_step, "fz-2pass": two_pass(shard.fz()), "ds": shard.ds(False), "ds+cast": shard.ds(True)}


def check(n: int) -> tuple[bool, float]:
    """(fz's update == fz's reference bit for bit over 3 steps, DeepSpeed's largest difference from
    it in units of the lr: how much of one step's size the two disagree on)."""
    import torch
    fast, ref, ds = Shard(n, seed=1), Shard(n, seed=1), Shard(n, seed=1)
    f, d = fast.fz(), ds.ds(True)
    for count in (1, 2, 3):
        f()
        d()
        torch._fused_adamw_([ref.p], [ref.g], [ref.m], [ref.v], [], [torch.tensor(float(count))], lr=LR,
                            beta1=BETAS[0], beta2=BETAS[1], weight_decay=WD, eps=EPS, amsgrad=False, maximize=False)
        ref.low.copy_(ref.p)
    same = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in
               ((fast.p, ref.p), (fast.m, ref.m), (fast.v, ref.v)))
    same = same and torch.equal(fast.low.view(torch.int16), ref.low.view(torch.int16))
    return same, float((ds.p - ref.p).abs().max()) / LR


def run(sizes: list[int], threads: list[int], rounds: int) -> dict:
    import torch
    out: dict = {}
    for n in sizes:
        shard = Shard(n)
        fns = engines(shard)
        for t in threads:  # warm-up: every engine once per thread count
            torch.set_num_threads(t)
            for fn in fns.values():
                fn()
        times = {(t, e): [] for t in threads for e in ENGINES}
        for r in range(rounds):
            for t in threads:
                torch.set_num_threads(t)
                order = ENGINES[r % len(ENGINES):] + ENGINES[:r % len(ENGINES)]
                for e in order:
                    start = time.perf_counter()
                    fns[e]()
                    times[t, e].append(time.perf_counter() - start)
            log.info("size %.0fM round %d/%d done (load %s)", n / 1e6, r + 1, rounds, load_average())
        out[n] = times
        del fns, shard
    return out


def ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of b[r] / a[r]: a's elements/s over b's."""
    return statistics.median(y / x for x, y in zip(a, b))


def table(results: dict) -> str:
    rows = []
    for n, times in results.items():
        for t in sorted({t for t, _ in times}):
            rate = {e: n / statistics.median(times[t, e]) / 1e6 for e in ENGINES}
            rows.append([f"{n / 1e6:.0f}M", str(t), *(f"{rate[e]:.0f}" for e in ENGINES),
                         f"{ratio(times[t, 'fz'], times[t, 'ds']):.2f}x",
                         f"{ratio(times[t, 'fz'], times[t, 'ds+cast']):.2f}x",
                         f"{ratio(times[t, 'fz'], times[t, 'fz-2pass']):.2f}x"])
    header = ["shard", "threads", *(f"{e} Melem/s" for e in ENGINES), "fz/ds", "fz/ds+cast", "fz/fz-2pass"]
    return markdown(header, rows, right_from=1)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args()
    import deepspeed
    import torch

    from fz.optim import kernel

    sizes = [int(float(s)) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    built = kernel._library() if kernel.enabled() else None
    log.info("torch %s (CPU capability %s), DeepSpeed %s, %s; fz's one-pass kernel: %s", torch.__version__,
             torch.backends.cpu.get_cpu_capability(), deepspeed.__version__, git_state(),
             "built and checked" if built else "not used (two passes)")
    same, rel = check(args.check_numel)
    gomp = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line})
    log.info("OpenMP runtimes loaded: %s (one: DeepSpeed's op follows torch.set_num_threads)", gomp)
    start_load = load_average()
    results = run(sizes, threads, args.rounds)
    print(f"\nbit for bit against fz's reference (torch's fused AdamW, then the cast), {args.check_numel:,} "
          f"elements, 3 steps: {'identical' if same else 'DIFFERENT'}; DeepSpeed's masters differ from it by at "
          f"most {rel:.1e} x lr")
    print(f"load average {start_load} at the start, {load_average()} at the end; {args.rounds} rounds\n")
    print(table(results))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
