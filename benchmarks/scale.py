"""fz stage 3 at world 1, 2, 4: step time, peak RSS per rank and model-state bytes per rank.

    OMP_NUM_THREADS=1 /work/venv/bin/python benchmarks/scale.py
    OMP_NUM_THREADS=1 /work/venv/bin/python benchmarks/scale.py --worlds 1,2,4 --params 20e6 --steps 8 --warmup 3

Same GPT, optimizer and per-rank micro-batch as benchmarks/step.py (whose worker runs each
rank: a fresh group of processes per world size), with the model built on the meta device so
fz.init materialises only each rank's rows (the full model never exists on a rank). Model-state
bytes are fz.memory_report's measured total (parameters + gradients + optimizer state, incl.
bucket padding) and the ZeRO formula 16Ψ/N; both should fall as 1/N. Peak RSS (VmHWM, max over ranks) also holds torch
itself (the "base", taken after init_process_group) and activations, which do not shrink with N.
With only 2 cores, world 4 runs two ranks per core, so its step time is not a scaling result.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import fmt, git_state, launch, load_average, markdown, median

STEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step.py")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--params", type=float, default=20e6, help="target model size (parameters)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    print("$ " + shlex.join(["OMP_NUM_THREADS=1", sys.executable, *sys.argv]), flush=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average at start {load_average()}, "
          f"{git_state()}", flush=True)
    common = ["--params", str(args.params), "--seq", str(args.seq), "--micro-batch", str(args.micro_batch),
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--meta-init"]
    results = {}
    for w in worlds:
        t0 = time.monotonic()
        cmd = [sys.executable, STEP, *common, "--world", str(w), "--worker", "fz3",
               "--worker-precision", args.precision]
        results[w] = r = launch(cmd, w, args.timeout)
        status = r.get("error") or f"{1e3 * median(r['times'][args.warmup:]):.1f} ms"
        print(f"  world {w}: {status}  ({time.monotonic() - t0:.1f}s, load {load_average()})", flush=True)
        for line in r.get("tail", []):
            print(f"      | {line}", flush=True)

    ok = {w: r for w, r in results.items() if "error" not in r}
    if not ok:
        sys.exit("every world size failed")
    meta = next(iter(ok.values()))
    first = ok[min(ok)]
    mib = 2 ** 20
    print(f"\nfz stage 3, {args.precision}, GPT {meta['params'] / 1e6:.2f}M params (dim {meta['dim']}, "
          f"{meta['layers']} layers), seq {args.seq}, micro-batch {args.micro_batch}/rank, gloo CPU, "
          f"median of steps {args.warmup}-{args.steps - 1}; load average at end {load_average()}\n")
    header = ["world", "step ms", "peak RSS MB/rank", "over base MB", "model state MiB/rank (measured)",
              "ZeRO formula MiB/rank", f"measured vs world {min(ok)}", "1/N", "sent MB/step/rank"]
    rows = []
    for w in worlds:
        r = results[w]
        if "error" in r:
            rows.append([str(w), f"FAILED: {r['error']}"] + [""] * (len(header) - 2))
            continue
        mem = r["fz_memory"]
        rows.append([str(w), f"{1e3 * median(r['times'][args.warmup:]):.1f}", f"{r['rss_mb']:.0f}",
                     f"{r['rss_mb'] - r['base_mb']:.0f}", f"{mem['total'] / mib:.2f}",
                     f"{mem['formula_total'] / mib:.2f}",
                     fmt(mem["total"] / first["fz_memory"]["total"], ".3f"), f"{min(ok) / w:.3f}",
                     f"{median(r['sent'][args.warmup:]) / 1e6:.2f}"])
    print(markdown(header, rows))


if __name__ == "__main__":
    main()
