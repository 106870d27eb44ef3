"""Offload: step time and peak RSS of fz stages 2-3 with no offload, CPU and NVMe offload (and
DeepSpeed's CPU offload where it runs), the NVMe tier's bandwidth against dd, and the headline:
a model whose states are 1.5x this machine's memory, trained at world 2.

    OMP_NUM_THREADS=1 /work/venv/bin/python benchmarks/offload.py --dir /work/offload-bench
    OMP_NUM_THREADS=1 /work/venv/bin/python benchmarks/offload.py --dir /work/offload-bench --headline --params 2.5e9

Each engine run is a fresh world-2 group (benchmarks/_harness.launch). "moved MB" is what the
NVMe tier reads and writes per step and rank (the optimizer state twice: read, then written
to new files; plus parameter shards read in forward and backward at stage 3 with params=True).
The dd lines write and read a file of the same size with O_DIRECT on the same disk.

--headline also prints rank 0's per-step split (medians over the measured steps): process
kernel/user CPU and page faults (getrusage, all threads), the main thread's CPU time ("compute":
the step runs on the main thread, so this is its compute without I/O waits), wall time and bytes
of the disk tier's reads/writes, of disk_update and of parameter loads, wall time in collectives,
and the floor: bytes both ranks moved / dd's O_DIRECT bandwidth (read and written apart); the
wrappers that time the parts are in benchmarks/offload_timers.py.
--baseline REF runs the same engine from a temporary worktree of REF too, interleaved:

    OMP_NUM_THREADS=1 /work/venv/bin/python benchmarks/offload.py --dir /work/offload-bench --headline \
        --params 150e6 --dim 1024 --steps 3 --warmup 1 --micro-batch 1 --baseline main --repeats 2
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import ROOT, finish, git_state, gpt_config, launch, load_average, markdown, median, report, rss_mb
from offload_timers import instrument, usage

ENGINES = ["fz2", "fz2-cpu", "fz2-nvme", "fz3", "fz3-cpu", "fz3-nvme", "fz3-nvme-params", "ds2-cpu", "ds3-cpu"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="the NVMe tier's directory (created if missing)")
    p.add_argument("--engines", default=",".join(e for e in ENGINES if not e.startswith("ds")))
    p.add_argument("--with-deepspeed", action="store_true", help="add DeepSpeed's offload_optimizer: cpu")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--params", type=float, default=50e6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dim", type=int, default=0, help="model width (default: benchmarks' usual 4-layer width)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--buffer-mb", type=float, default=64.0)
    p.add_argument("--headline", action="store_true", help="one run: stage 3, NVMe params + optimizer, meta init")
    p.add_argument("--same-batch", action="store_true", help="every step trains on the first batch (loss must fall)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--baseline", default=None, metavar="REF",
                   help="also run the engines from a temporary worktree of git REF, interleaved with this tree's")
    p.add_argument("--repeats", type=int, default=1, help="with --baseline: baseline, new, ... this many times")
    p.add_argument("--thp", default=os.environ.get("THP_MEM_ALLOC_ENABLE", "1"), choices=["0", "1"],
                   help="THP_MEM_ALLOC_ENABLE for every run, baseline included (default 1, as `fz run` sets it)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def headline_model(params: float = 2.5e9, seq: int = 128, dim: int = 3072):
    """The headline's model, as RESULTS.md ran it (`fz plan --model benchmarks/offload.py:headline_model`:
    built on the meta device)."""
    from fz.testing.gpt import GPT
    return GPT(gpt_config(int(params), seq, dim)[0])


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from fz.testing.gpt import GPT, lm_loss, synthetic_tokens

    torch.set_num_threads(1)
    engine = args.worker
    if engine.startswith("ds"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = rss_mb("VmRSS")
    cfg, n = gpt_config(int(args.params), args.seq, args.dim)
    torch.manual_seed(0)
    meta = args.headline or not engine.startswith("ds")
    with torch.device("meta") if meta else torch.device("cpu"):
        model = GPT(cfg)
    data = synthetic_tokens(args.steps * args.micro_batch, cfg.seq, cfg.vocab, seed=1000 + rank)
    stage = int(engine[2])
    totals: dict = {}
    t_init = time.perf_counter()
    if engine.startswith("fz"):
        import fz
        path = os.path.join(args.dir, f"rank{rank}")
        os.makedirs(path, exist_ok=True)
        kind = engine.split("-", 1)[1] if "-" in engine else ""
        policy = {
            "": None,
            "cpu": fz.offload.cpu(),
            "nvme": fz.offload.nvme(path, buffer_mb=args.buffer_mb, buffers=4, prefetch=2),
            "nvme-params": fz.offload.nvme(path, params=True, buffer_mb=args.buffer_mb, buffers=4, prefetch=2),
        }[kind]
        spec = fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=args.lr), clip_grad_norm=1.0, precision=args.precision,
                       loss_fn=lm_loss, offload=policy)
        box = {"s": fz.init(model, spec)}
        instrument(totals)

        def step(batch):
            box["s"], loss = fz.train_step(box["s"], batch)
            return loss
    else:
        cfg_ds = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
                  "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
                  "bf16": {"enabled": args.precision == "bf16"}, "steps_per_print": 10**9}
        eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg_ds)

        def step(batch):
            loss = lm_loss(eng, batch)
            eng.backward(loss)
            eng.step()
            return loss.detach()
    t_init = time.perf_counter() - t_init
    times, losses, splits = [], [], []
    for i in range(args.steps):
        dist.barrier()
        before, u0 = dict(totals), usage()
        t0 = time.perf_counter()
        j = 0 if args.same_batch else i
        losses.append(float(step(data[j * args.micro_batch:(j + 1) * args.micro_batch])))
        times.append(time.perf_counter() - t0)
        u1 = usage()
        splits.append({**{k: v - before.get(k, 0.0) for k, v in totals.items()}, **{k: u1[k] - u0[k] for k in u0}})
    # bytes the disk tier moved per step, both ranks (they share the disk): the floor's numerator
    moved = torch.tensor([[s.get(k, 0.0) for k in ("io_read_bytes", "io_write_bytes", "pool_read_bytes",
                                                    "pool_write_bytes")] for s in splits], dtype=torch.float64)
    dist.all_reduce(moved)
    for s, m in zip(splits, moved.tolist()):
        s["both_read_bytes"], s["both_write_bytes"] = (m[0], m[1]) if m[0] + m[1] else (m[2], m[3])
    out = {"times": times, "loss": losses, "rss_mb": rss_mb("VmHWM"), "base_mb": base, "params": n, "init_s": t_init,
           "splits": splits}
    if engine.startswith("fz"):
        r = fz.memory_report(box["s"])
        out["tiers"] = r.tiers
        out["fz"] = os.path.dirname(os.path.dirname(os.path.abspath(fz.__file__)))  # which tree (--baseline)
        out["state_bytes"] = r.total
    t = torch.tensor([max(times[args.warmup:] or times), out["rss_mb"]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        report(out)
    finish(dist)


def dd_bandwidth(directory: str, mb: int) -> dict:
    """dd's O_DIRECT write (a new file), overwrite (the same file again, conv=notrunc: what the
    NVMe tier's in-place update does) and read MB/s for a file of `mb` MiB in `directory`."""
    path = os.path.join(directory, "dd-probe")
    out = {}
    write = ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={max(1, mb // 16)}", "oflag=direct"]
    for what, cmd in (("write", [*write, "conv=fsync"]), ("overwrite", [*write, "conv=fsync,notrunc"]),
                      ("read", ["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"])):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        out[what] = max(1, mb // 16) * 16 / (time.perf_counter() - t0)
    os.unlink(path)
    return out


def tier_bandwidth(directory: str, mb: int, buffer_mb: float) -> dict:
    """The NVMe tier's own write/read MB/s: its IOPool moving `mb` MiB through its buffers, which
    hold data (as the update's do). "write" is what a step does since the update writes in place:
    an overwrite of a file fz.init wrote once (timed apart: "first write")."""
    from fz.offload.policy import nvme
    from fz.storage.store import store_for
    policy = nvme(directory, buffer_mb=buffer_mb, buffers=4)
    store = store_for(directory, True)
    io = store.io_pool(policy)
    size = int(buffer_mb * 2**20)
    n = max(1, int(mb * 2**20) // size)
    blob = store.new_blob("bandwidth", n * size)
    for buf in io.buffers:
        buf.random_(0, 256)
    out = {"direct": store.direct}
    for what in ("first write", "write", "read"):
        t0 = time.perf_counter()
        futs = [(io.read if what == "read" else io.write)(blob, i * size, size, io.buffers[i % len(io.buffers)])
                for i in range(n)]
        for f in futs:
            f.result()
        if what != "read":
            fd = os.open(blob.path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        out[what] = n * size / 2**20 / (time.perf_counter() - t0)
    blob.remove_now()
    return out


def _worker_argv(argv: list[str]) -> list[str]:
    """The command line without --baseline/--repeats (the workers need neither)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--baseline", "--repeats"):
            skip = True
        elif not a.startswith(("--baseline=", "--repeats=")):
            out.append(a)
    return out


def _baseline_tree(ref: str) -> str:
    """A temporary detached worktree of `ref` (removed by main when the runs are done)."""
    import tempfile
    path = tempfile.mkdtemp(prefix="fz-baseline-")
    os.rmdir(path)
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, ref], check=True, capture_output=True)
    print(f"baseline: {ref} in {path} ({git_state(path)})", flush=True)
    return path


SPLIT_KEYS = ("user", "kernel", "minflt", "majflt", "compute", "io_read", "io_write", "io_read_bytes",
              "io_write_bytes", "pool_read", "pool_write", "disk_update", "load", "comm", "comm_wait",
              "both_read_bytes", "both_write_bytes")


def _split(runs: list[dict], warmup: int) -> dict | None:
    """Per-step medians over the measured steps (then over repeats) of rank 0's split."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return None
    per = [{"step": median(r["times"][warmup:]),
            **{k: median(s.get(k, 0.0) for s in r["splits"][warmup:]) for k in SPLIT_KEYS}} for r in ok]
    return {k: median(p[k] for p in per) for k in per[0]}


def headline_split(args, runs: dict, moved: dict) -> None:
    """The headline's per-step time split (rank 0), the floor, the tier's bandwidth, the baseline ratios."""
    splits = {label: _split(rs, args.warmup) for label, rs in runs.items()}
    both = max((s["both_read_bytes"] + s["both_write_bytes"] for s in splits.values() if s), default=0)
    size = max(16, min(1024, int(both / 2**20)))
    dd, tier = dd_bandwidth(args.dir, size), tier_bandwidth(args.dir, size, args.buffer_mb)
    print(f"\nDisk bandwidth, {size} MiB: dd O_DIRECT write {dd['write']:.0f} MiB/s (overwrite "
          f"{dd['overwrite']:.0f}), read {dd['read']:.0f} MiB/s; fz's NVMe tier (O_DIRECT "
          f"{'on' if tier['direct'] else 'off'}, in place) write {tier['write']:.0f} MiB/s "
          f"({tier['write'] / dd['write']:.2f}x dd's write, {tier['write'] / dd['overwrite']:.2f}x its overwrite; "
          f"target >= 0.9x; first write {tier['first write']:.0f}), read {tier['read']:.0f} MiB/s "
          f"({tier['read'] / dd['read']:.2f}x dd)")
    rows = []
    for label, s in splits.items():
        if s is None:
            rows.append([label, "FAILED"] + [""] * 15)
            continue
        floor = s["both_read_bytes"] / 2**20 / dd["read"] + s["both_write_bytes"] / 2**20 / dd["write"]
        s["floor"] = floor
        s["of_floor"] = s["step"] / max(s["compute"], floor)
        rows.append([label, f"{1e3 * s['step']:.0f}", f"{1e3 * s['compute']:.0f}", f"{1e3 * s['user']:.0f}",
                     f"{1e3 * s['kernel']:.0f}", f"{s['kernel'] / max(s['user'], 1e-9):.2f}",
                     f"{s['minflt']:.0f}", f"{s['majflt']:.0f}",
                     f"{1e3 * s['io_read']:.0f} ({s['io_read_bytes'] / 2**20:.0f})",
                     f"{1e3 * s['io_write']:.0f} ({s['io_write_bytes'] / 2**20:.0f})",
                     f"{1e3 * (s['pool_read'] + s['pool_write']):.0f}", f"{1e3 * s['disk_update']:.0f}",
                     f"{1e3 * s['load']:.0f}", f"{1e3 * s['comm']:.0f} + {1e3 * s['comm_wait']:.0f}",
                     f"{(s['both_read_bytes'] + s['both_write_bytes']) / 2**20:.0f}", f"{1e3 * floor:.0f}",
                     f"{s['of_floor']:.2f}x"])
    print("\nPer-step split, rank 0, medians over the measured steps (process CPU and faults: all threads; compute: "
          "the main thread's CPU time; I/O: wall time in the disk reads/writes incl. checksums, summed over threads; "
          "comm: wall time in Comm's collective calls + in waits on their async handles outside them)\n")
    print(markdown(["engine", "step ms", "compute ms", "user ms", "kernel ms", "kernel/user", "minflt/step",
                    "majflt/step", "disk read ms (MiB)", "disk write ms (MiB)", "pool _io ms", "disk_update ms",
                    "param loads ms", "comm ms (calls + waits)", "moved MiB/step both ranks", "floor ms",
                    "x of floor (target <= 1.25)"], rows))
    for label, s in splits.items():
        if s:
            print(f"{label}: step {1e3 * s['step']:.0f} ms / max(compute alone {1e3 * s['compute']:.0f} ms, floor "
                  f"{1e3 * s['floor']:.0f} ms) = {s['of_floor']:.2f}x of floor (target <= 1.25)")
    for label, s in splits.items():
        b = splits.get(label + "@base")
        if s and b and not label.endswith("@base"):
            r = {k: f"{s[k] / b[k]:.3f}x" if b[k] else "-" for k in ("step", "minflt", "majflt", "kernel", "user",
                                                                      "compute")}
            print(f"{label} new/baseline: step {r['step']}, minor faults {r['minflt']}, major faults {r['majflt']}, "
                  f"kernel time {r['kernel']}, user time {r['user']}, compute {r['compute']}")


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    os.makedirs(args.dir, exist_ok=True)
    argv = sys.argv[1:]
    print("$ " + shlex.join(["OMP_NUM_THREADS=1", sys.executable, *sys.argv]), flush=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average {load_average()}, {git_state()}, "
          f"THP_MEM_ALLOC_ENABLE={args.thp}", flush=True)
    engines = ["fz3-nvme-params"] if args.headline else [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.with_deepspeed and not args.headline:
        engines += ["ds2-cpu", "ds3-cpu"]
    rows, results = [], {}
    base_root = _baseline_tree(args.baseline) if args.baseline else None
    try:
        for rep in range(args.repeats if base_root else 1):
            for e in engines:
                for label, root in ([(e + "@base", base_root)] if base_root else []) + [(e, None)]:
                    t0 = time.monotonic()
                    env = {"DS_ACCELERATOR": "cpu"} if e.startswith("ds") else {}
                    env["THP_MEM_ALLOC_ENABLE"] = args.thp
                    if root:  # the worker is this file; fz comes from the baseline's tree
                        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
                    res = launch([sys.executable, os.path.abspath(__file__), *_worker_argv(argv), "--worker", e], 2,
                                 args.timeout, env or None)
                    results.setdefault(label, []).append(res)
                    status = res.get("error") or (f"{1e3 * median(res['times'][args.warmup:]):.0f} ms, "
                                                  f"fz from {res.get('fz')}")
                    print(f"  {label:<20} {status} ({time.monotonic() - t0:.0f}s)" +
                          (f" repeat {rep + 1}/{args.repeats}" if base_root else ""), flush=True)
                    for line in res.get("tail", []) if "error" in res else []:
                        print(f"      | {line}", flush=True)
    finally:
        if base_root:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base_root], check=False,
                           capture_output=True)
    runs = results
    results = {k: next((r for r in v if "error" not in r), v[-1]) for k, v in runs.items()}
    moved = {}
    for e, r in results.items():
        if "error" in r:
            rows.append([e, f"FAILED: {r['error']}"] + [""] * 8)
            continue
        disk = r.get("tiers", {}).get("disk", {})
        on_disk = sum(disk.values())
        param_disk = disk.get("params", 0)
        moved[e] = 2 * on_disk + 2 * param_disk  # opt read + written; params read twice (forward, backward)
        step = median(r["times"][args.warmup:])
        split = {k: median(s.get(k, 0.0) for s in r["splits"][args.warmup:]) for k in ("disk_update", "load", "_hash")}
        rows.append([e, f"{1e3 * step:.0f}", f"{r['rss_mb']:.0f}", f"{r['rss_mb'] - r['base_mb']:.0f}",
                     f"{on_disk / 2**20:.0f}", f"{moved[e] / 2**20:.0f}", f"{1e3 * split['disk_update']:.0f}",
                     f"{1e3 * split['load']:.0f}", f"{1e3 * split['_hash']:.0f} ({100 * split['_hash'] / step:.1f}%)",
                     f"{r['init_s']:.1f}", " ".join(f"{x:.3f}" for x in r["loss"])])
    meta = next((r for r in results.values() if "params" in r), {})
    print(f"\nGPT {meta.get('params', 0) / 1e6:.0f}M params, {args.precision}, world 2, micro-batch "
          f"{args.micro_batch} x seq {args.seq}/rank, median of steps {args.warmup}-{args.steps - 1}; "
          f"load average at end {load_average()}\n")
    print(markdown(["engine", "step ms", "peak RSS MB/rank", "over base MB", "on disk MiB/rank", "moved MiB/step/rank",
                    "optimizer+I/O ms", "param reads ms", "hashing ms (of step)", "init s", "losses"], rows))
    if args.headline:
        return headline_split(args, runs, moved)
    if not args.headline:
        size = max(256, int(max(moved.values(), default=0) / 2 / 2**20))
        dd, tier = dd_bandwidth(args.dir, size), tier_bandwidth(args.dir, size, args.buffer_mb)
        print(
            f"\nDisk bandwidth, {size} MiB: dd O_DIRECT write {dd['write']:.0f} MB/s, read {dd['read']:.0f} MB/s; "
            f"fz's NVMe tier (O_DIRECT {'on' if tier['direct'] else 'off'}) write {tier['write']:.0f} MiB/s "
            f"({tier['write'] / dd['write']:.2f}x dd), read {tier['read']:.0f} MiB/s "
            f"({tier['read'] / dd['read']:.2f}x dd)"
        )
        for s in (2, 3):
            base, nv = results.get(f"fz{s}"), results.get(f"fz{s}-nvme")
            if base and nv and "error" not in base and "error" not in nv:
                bw = 2 / (1 / dd["write"] + 1 / dd["read"]) * 2**20  # bytes/s, half read, half written
                # both ranks' files are on this one disk: the step moves 2x a rank's bytes through it
                allowed = median(base["times"][args.warmup:]) + 2 * moved[f"fz{s}-nvme"] / bw
                got = median(nv["times"][args.warmup:])
                print(f"fz{s}-nvme step {1e3 * got:.0f} ms vs in-memory + moved (both ranks) / bandwidth "
                      f"{1e3 * allowed:.0f} ms: "
                      f"{got / allowed:.2f}x (target <= 1.20x)")


if __name__ == "__main__":
    main()
