"""Step time and peak RSS of fz stages 0-3 against DDP and FSDP2, world size 2 on CPU (gloo).

    OMP_NUM_THREADS=1 /work/venv/bin/python benchmarks/step.py --repeats 2
    OMP_NUM_THREADS=1 /work/venv/bin/python benchmarks/step.py --engines ddp,fsdp2,fz0 --steps 25 --warmup 5

Every engine trains the same GPT (same initial weights, AdamW lr 1e-3, wd 0.01, clip 1.0, lm_loss)
on per-rank synthetic tokens. Each engine run is a fresh group of `--world` processes, so the
peak RSS (VmHWM) of one engine does not leak into another. With `--repeats R` engines are
interleaved (A B C .. A B C ..) and the table shows medians over repeats. Step time is the
median over steps [warmup, steps) of the slowest rank, timed from a barrier to `float(loss)`.
Peak RSS is VmHWM, max over ranks; "over base" subtracts the RSS right after `import torch` and
`init_process_group` (about 220 MB of the total is torch itself).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ["ddp", "fsdp2", "fsdp2-noreshard", "fz0", "fz1", "fz2", "fz3"]
TAG = "FZBENCH "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list from {ENGINES}")
    p.add_argument("--params", type=float, default=5e6, help="target model size (parameters)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=25, help="steps per run, warmup included")
    p.add_argument("--warmup", type=int, default=5, help="leading steps left out of the median")
    p.add_argument("--repeats", type=int, default=1, help="interleaved runs of every engine")
    p.add_argument("--world", type=int, default=2, help="ranks per engine run")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is killed")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one rank
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must be larger than --warmup")
    return args


# ----------------------------------------------------------------------------- worker (one rank)

def gpt_config(target: int, seq: int):
    """gpt_for_params' width (vocab 4096), with the layer count that lands nearest `target`."""
    import torch
    from fz.testing.gpt import GPT, GPTConfig, gpt_for_params

    base = gpt_for_params(target, seq=seq)

    def count(layers: int) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in GPT(GPTConfig(**{**base.__dict__, "layers": layers})).parameters())

    layers = min(range(1, 65), key=lambda n: abs(count(n) - target))
    return GPTConfig(**{**base.__dict__, "layers": layers}), count(layers)


def build_step(engine: str, model, lm_loss):
    """Returns step(batch) -> loss tensor, for one engine, after wrapping `model`."""
    import torch

    def eager(module, params):
        opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

        def step(batch):
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(module, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            opt.step()
            return loss.detach()
        return step

    if engine == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return eager(ddp, ddp.parameters())
    if engine in ("fsdp2", "fsdp2-noreshard"):
        from torch.distributed.fsdp import fully_shard
        reshard = engine == "fsdp2"
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        return eager(model, model.parameters())
    if engine.startswith("fz"):
        import fz
        spec = fz.Spec(stage=int(engine[2:]),
                       optimizer=fz.optim.adamw(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
                       grad_accum=1, clip_grad_norm=1.0, precision="fp32", loss_fn=lm_loss, seed=0)
        box = {"state": fz.init(model, spec)}

        def step(batch):
            box["state"], loss = fz.train_step(box["state"], batch)
            return loss
        return step
    raise ValueError(f"unknown engine {engine!r}; choose from {ENGINES}")


def rss_mb(key: str = "VmHWM") -> float:
    """VmHWM (peak) or VmRSS (now) of this process, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB -> MB
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def source_hash() -> str:
    """Hash of fz/**/*.py (model included), to catch fz changing in the middle of a run."""
    import hashlib
    h = hashlib.sha1()
    for dirpath, dirs, files in sorted(os.walk(os.path.join(ROOT, "fz"))):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(dirpath, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:10]


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from fz.testing.gpt import GPT, lm_loss, synthetic_tokens

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base_mb = rss_mb("VmRSS")                  # torch + gloo, before any model memory
    cfg, n_params = gpt_config(int(args.params), args.seq)
    torch.manual_seed(0)                       # same initial weights for every engine and rank
    model = GPT(cfg)
    data = synthetic_tokens(args.steps * args.micro_batch, cfg.seq, cfg.vocab, seed=1000 + rank)
    step = build_step(args.worker, model, lm_loss)
    del model  # DDP and FSDP2 keep it inside their wrappers; fz needs it no more after init

    times, losses = [], []
    for i in range(args.steps):
        batch = data[i * args.micro_batch:(i + 1) * args.micro_batch]
        dist.barrier()
        t0 = time.perf_counter()
        loss = float(step(batch))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    # step time of a step = its slowest rank; losses averaged over ranks
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    l = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(l, op=dist.ReduceOp.SUM)
    rss = torch.tensor([rss_mb("VmHWM"), base_mb], dtype=torch.float64)  # max over ranks
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(TAG + json.dumps({"times": t.tolist(), "loss": (l / dist.get_world_size()).tolist(),
                                "rss_mb": rss[0].item(), "base_mb": rss[1].item(),
                                "params": n_params, "layers": cfg.layers, "dim": cfg.dim,
                                "src": source_hash()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads sometimes abort there ("terminate called ...")


# ----------------------------------------------------------------------------- launcher

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_engine(engine: str, args, argv) -> dict:
    """Spawns `--world` fresh ranks running `engine`; returns rank 0's result or {'error': ...}."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(args.world), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", engine]
    procs, logs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.world):
            out = open(os.path.join(tmp, f"rank{r}.log"), "w+")
            logs.append(out)
            procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        deadline, error = time.monotonic() + args.timeout, None
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                error = f"rank {failed[0]} exited with {procs[failed[0]].returncode}"
                break
            if time.monotonic() > deadline:
                error = f"timeout after {args.timeout:.0f}s"
                break
            time.sleep(0.1)
        for p in procs:                         # only the ranks started above, by pid
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
    tail = [ln for ln in bad.strip().splitlines() if ln.strip() and not ln.startswith(TAG)][-3:]
    if result is not None:                      # all steps measured, then a crash or hang at exit
        return {**result, "warning": f"{error} after reporting", "tail": tail}
    return {"error": error or "no result line", "tail": tail}


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        sys.exit(f"unknown engines {unknown}; choose from {ENGINES}")
    print("$ " + shlex.join(["OMP_NUM_THREADS=1", sys.executable, *sys.argv]), flush=True)
    t_start = time.monotonic()
    runs = {e: [] for e in engines}
    for rep in range(args.repeats):
        for e in engines:
            t0 = time.monotonic()
            res = run_engine(e, args, argv)
            runs[e].append(res)
            status = res.get("error") or f"{1e3 * statistics.median(res['times'][args.warmup:]):.1f} ms"
            status += f"  WARNING: {res['warning']}" if "warning" in res else ""
            print(f"  repeat {rep + 1}/{args.repeats} {e:<16} {status}  ({time.monotonic() - t0:.1f}s)",
                  flush=True)
            for line in res.get("tail", []):
                print(f"      | {line}", flush=True)

    def summary(e):
        ok = [r for r in runs[e] if "error" not in r]
        if not ok:
            return None
        per_run = [statistics.median(r["times"][args.warmup:]) for r in ok]
        return {"step": statistics.median(per_run), "spread": (min(per_run), max(per_run)), "n": len(ok),
                "rss": statistics.median(r["rss_mb"] for r in ok),
                "base": statistics.median(r["base_mb"] for r in ok),
                "loss": statistics.median(r["loss"][-1] for r in ok), "meta": ok[0],
                "warn": sum("warning" in r for r in ok)}

    rows = {e: summary(e) for e in engines}
    meta = next((s["meta"] for s in rows.values() if s), None)
    if meta:
        print(f"\nGPT {meta['params'] / 1e6:.2f}M params (dim {meta['dim']}, {meta['layers']} layers), "
              f"seq {args.seq}, micro-batch {args.micro_batch}/rank, world {args.world}, gloo CPU, "
              f"median of steps {args.warmup}-{args.steps - 1}, {args.repeats} repeat(s)")
    sources = {r["src"] for rs in runs.values() for r in rs if "src" in r}
    if len(sources) > 1:
        print(f"WARNING: fz/ sources changed during the run ({len(sources)} versions); rerun")
    ddp = rows.get("ddp")
    print("\n| engine | step ms (median) | min-max over repeats | peak RSS MB/rank | over base MB | vs DDP | final loss |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for e in engines:
        s = rows[e]
        if s is None:
            print(f"| {e} | FAILED: {runs[e][-1]['error']} | | | | | |")
            continue
        ratio = f"{s['step'] / ddp['step']:.2f}x" if ddp else "-"
        name = f"{e} (exit error in {s['warn']}/{s['n']} runs)" if s["warn"] else e
        print(f"| {name} | {1e3 * s['step']:.1f} | {1e3 * s['spread'][0]:.1f}-{1e3 * s['spread'][1]:.1f} "
              f"| {s['rss']:.0f} | {s['rss'] - s['base']:.0f} | {ratio} | {s['loss']:.4f} |")
    print(f"\ntotal wall time {time.monotonic() - t_start:.1f}s")


if __name__ == "__main__":
    main()
