"""Checkpoint save/restore time and throughput of fz at world 2, against the disk (dd),
a bare dcp.save of the same tensors, and FSDP2 (fully_shard) + DCP's own save/load.

    OMP_NUM_THREADS=1 /work/venv/bin/python benchmarks/ckpt.py --dir /tmp/fz_ckpt_bench --repeats 5
    ... benchmarks/ckpt.py --size 1GB --repeats 3 --baseline /path/to/old/checkout   # before/after

State bytes = parameters + AdamW moments (12 bytes per parameter, fp32), ~100 MB by default
(`--size` picks the model's depth and width for another). Every time is the slowest rank's,
barrier to barrier, median over `--repeats`. MB/s is state MB / time. Saves fsync every file;
"restore" reads from the page cache (just written), "cold" after `echo 3 > drop_caches` (root).
`--baseline` runs another checkout's fz (its own processes, its own `fz`) in the same run,
alternating with this one repeat by repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("FZ_BENCH_ROOT", ROOT))  # --baseline: the other checkout's fz


def drop_caches() -> bool:
    """Empty the page cache (root only); False when not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def _dd(args: list[str], mb: int) -> float:
    res = subprocess.run(["dd", *args, "bs=4M", f"count={mb // 4}"], capture_output=True, text=True, timeout=600)
    m = re.search(r"copied, ([\d.]+) s", res.stderr)
    return (mb // 4) * 4 * 2**20 / 1e6 / float(m.group(1)) if m else float("nan")


def dd_bandwidth(directory: str, mb: int = 256) -> dict:
    """MB/s of `dd` on `directory`: writing `mb` MiB O_DIRECT and buffered + fdatasync, and reading
    it back O_DIRECT (from the disk: O_DIRECT bypasses the page cache)."""
    path = os.path.join(directory, "dd.bin")
    out = {"oflag=direct": _dd(["if=/dev/zero", f"of={path}", "oflag=direct"], mb),
           "iflag=direct": _dd([f"if={path}", "of=/dev/null", "iflag=direct"], mb)}
    os.unlink(path)
    out["conv=fdatasync"] = _dd(["if=/dev/zero", f"of={path}", "conv=fdatasync"], mb)
    os.unlink(path)
    return out


def config_for(size: str | None):
    """The benchmark GPT: 8.4M parameters (101 MB with AdamW) by default, else about `size`
    ("1GB", "800MB") of parameters + AdamW moments: width 1024, as many layers as it takes."""
    from fz.testing.gpt import GPTConfig
    if size is None:
        return GPTConfig(vocab=4096, seq=64, dim=512, heads=8, layers=2)
    m = re.fullmatch(r"([\d.]+)\s*([GM])B?", size.strip().upper())
    if not m:
        raise SystemExit(f"--size {size!r}: expected e.g. 1GB or 800MB")
    target = float(m.group(1)) * (1e9 if m.group(2) == "G" else 1e6) / 12  # parameters
    dim, vocab = 1024, 4096
    layers = max(1, round((target - 2 * vocab * dim) / (12 * dim * dim)))
    return GPTConfig(vocab=vocab, seq=64, dim=dim, heads=16, layers=layers)


def _timed(fn, group=None) -> float:
    import torch
    import torch.distributed as dist
    dist.barrier(group)
    t = time.perf_counter()
    fn()
    dist.barrier(group)
    dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
    return float(dt)


def _model(cfg):
    import torch

    from fz.testing.gpt import GPT
    torch.manual_seed(0)
    return GPT(cfg)


def _fz(rank: int, world: int, cfg, directory: str, repeats: int, stage: int) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    import fz
    from fz.ckpt import manifest, restore, save, wait_for_checkpoints
    from fz.ckpt.tree import entries
    from fz.testing.gpt import lm_loss, synthetic_tokens
    spec = fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=1e-3), loss_fn=lm_loss)
    state = fz.init(_model(cfg), spec)
    state, _ = fz.train_step(state, synthetic_tokens(2, cfg.seq, cfg.vocab, seed=rank))
    root = os.path.join(directory, f"fz{stage}")
    if rank == 0:  # each run starts empty (a --baseline run alternates with this one in the same place)
        shutil.rmtree(root, ignore_errors=True)
    torch.distributed.barrier()
    res: dict = {k: [] for k in ("save", "async_return", "async_total", "restore", "restore_cold", "dcp_only",
                                 "save_sha256")}
    for i in range(repeats):
        res["save"].append(_timed(lambda: save(state, root, step=100 + i, keep_last=2)))
        t = time.perf_counter()
        ret = _timed(lambda: save(state, root, step=200 + i, keep_last=2, async_=True))
        wait_for_checkpoints()
        res["async_return"].append(ret)
        res["async_total"].append(time.perf_counter() - t)
        fresh = fz.init(_model(cfg), spec)
        res["restore"].append(_timed(lambda: restore(fresh, root)))
        fresh = fz.init(_model(cfg), spec)
        torch.distributed.barrier()
        if rank == 0:
            drop_caches()
        res["restore_cold"].append(_timed(lambda: restore(fresh, root)))
        d = os.path.join(directory, f"dcp_only{stage}_{i}")
        res["dcp_only"].append(_timed(lambda: dcp.save(dict(entries(state)),
                                                       storage_writer=dcp.FileSystemWriter(d, sync_files=True))))
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
        manifest.ALGORITHM = "sha256"
        res["save_sha256"].append(_timed(lambda: save(state, root, step=300 + i, keep_last=2)))
        manifest.ALGORITHM = "crc32"
    res["bytes"] = sum(t.numel() * t.element_size() for t in entries(state).values())  # global sizes
    return res


def _fsdp2(rank: int, world: int, cfg, directory: str, repeats: int) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from fz.testing.gpt import lm_loss, synthetic_tokens
    model = _model(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lm_loss(model, synthetic_tokens(2, cfg.seq, cfg.vocab, seed=rank)).backward()
    opt.step()
    res = {"save": [], "async_return": [], "async_total": [], "restore": []}
    side = torch.distributed.new_group(backend="gloo")  # async_save's collectives run in a thread: own group
    for i in range(repeats):
        d = os.path.join(directory, f"fsdp2_{i}")
        msd, osd = get_state_dict(model, opt)
        res["save"].append(_timed(lambda: dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)))
        t = time.perf_counter()
        fut = {}
        ret = _timed(lambda: fut.setdefault("f", dcp.async_save({"model": msd, "optim": osd},
                                                                 checkpoint_id=d + "a", process_group=side)))
        fut["f"].result()
        res["async_return"].append(ret)
        res["async_total"].append(time.perf_counter() - t)

        def load():
            m, o = get_state_dict(model, opt)
            dcp.load({"model": m, "optim": o}, checkpoint_id=d)
            set_state_dict(model, opt, model_state_dict=m, optim_state_dict=o)
        res["restore"].append(_timed(load))
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
            shutil.rmtree(d + "a", ignore_errors=True)
    return res


def _fz_rounds(args, cfg, stage: int, baseline: bool) -> dict:
    """One fz run of `args.repeats`... in this process's fz, or the baseline's (a child process)."""
    from fz.testing.spawn import run_ranks
    if not baseline:
        return run_ranks(args.world, _fz, cfg, args.dir, 1, stage, timeout=900)[0]
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--_child", str(stage), "--dir", args.dir,
                          "--world", str(args.world), *(["--size", args.size] if args.size else [])],
                         env={**os.environ, "FZ_BENCH_ROOT": args.baseline, "PYTHONPATH": args.baseline},
                         capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"baseline run failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _list(xs: list[float]) -> str:
    return ", ".join(f"{x:.3f}" for x in xs)


def _merge(acc: dict, r: dict) -> None:
    for k, v in r.items():
        if isinstance(v, list):
            acc.setdefault(k, []).extend(v)
        else:
            acc[k] = v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/fz_ckpt_bench", help="where checkpoints (and dd) write")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stages", default="0,3")
    p.add_argument("--size", default=None, help="state size, e.g. 1GB (default: ~0.1 GB)")
    p.add_argument("--baseline", default=None, help="another fz checkout to measure in the same run (before/after)")
    p.add_argument("--no-fsdp2", action="store_true", help="skip FSDP2 + DCP")
    p.add_argument("--_child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    cfg = config_for(args.size)
    if args._child is not None:  # a baseline round: this file, the other checkout's fz
        from fz.testing.spawn import run_ranks
        print(json.dumps(run_ranks(args.world, _fz, cfg, args.dir, 1, args._child, timeout=900)[0]))
        return
    from fz.testing.spawn import run_ranks
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    load0 = os.getloadavg()
    dd = dd_bandwidth(args.dir, 1024 if args.size else 256)
    rows = []
    for stage in map(int, args.stages.split(",")):
        now: dict = {}
        before: dict = {}
        for i in range(args.repeats):  # alternate, baseline first on even repeats
            order = [True, False] if i % 2 == 0 else [False, True]
            for is_base in order if args.baseline else [False]:
                _merge(before if is_base else now, _fz_rounds(args, cfg, stage, is_base))
        if args.baseline:
            rows.append((f"fz stage {stage} (baseline)", before))
        rows.append((f"fz stage {stage}", now))
    if not args.no_fsdp2:
        rows.append(("FSDP2 + dcp", run_ranks(args.world, _fsdp2, cfg, args.dir, args.repeats, timeout=900)[0]))
    dd_end = dd_bandwidth(args.dir, 1024 if args.size else 256)  # the disk is shared: its better figure is the bar
    dd_start, dd = dd, {k: max(v, dd_end[k]) for k, v in dd.items()}
    last = os.path.join(args.dir, f"fz{args.stages.split(',')[-1]}")
    cons = consolidate_cost(last, args.dir) if args.size is None else None
    load1 = os.getloadavg()
    mb = rows[0][1]["bytes"] / 1e6
    med = statistics.median
    print(f"state: {mb:.1f} MB (params + AdamW moments; {cfg}), world {args.world}, {args.repeats} repeats, "
          f"dir {args.dir}; load average {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f} at start, "
          f"{load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f} at end")
    dw, dr = dd["oflag=direct"], dd["iflag=direct"]
    print(f"dd {1024 if args.size else 256} MiB bs=4M, the better of before and after: write oflag=direct {dw:.0f} "
          f"MB/s, conv=fdatasync {dd['conv=fdatasync']:.0f} MB/s; read iflag=direct {dr:.0f} MB/s (before: "
          f"{dd_start['oflag=direct']:.0f}, {dd_start['conv=fdatasync']:.0f}, {dd_start['iflag=direct']:.0f}; after: "
          f"{dd_end['oflag=direct']:.0f}, {dd_end['conv=fdatasync']:.0f}, {dd_end['iflag=direct']:.0f})\n")
    print("| engine | save s | save MB/s | save / dd write | async returns s | async total s | restore s | "
          "restore MB/s | cold restore s | cold MB/s | cold / dd read |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        s, a, at, rs = (med(r[k]) for k in ("save", "async_return", "async_total", "restore"))
        cold = f"{med(r['restore_cold']):.3f} | {mb / med(r['restore_cold']):.0f} | " \
               f"{mb / med(r['restore_cold']) / dr:.2f}" if r.get("restore_cold") else "- | - | -"
        print(f"| {name} | {s:.3f} | {mb / s:.0f} | {mb / s / dw:.2f} | {a:.3f} | {at:.3f} | {rs:.3f} | "
              f"{mb / rs:.0f} | {cold} |")
    for name, r in rows:
        if "dcp_only" in r:
            ratio = med([a / b for a, b in zip(r["save"], r["dcp_only"])])
            print(f"\n{name}: bare dcp.save of the same tensors {med(r['dcp_only']):.3f} s "
                  f"({mb / med(r['dcp_only']):.0f} MB/s); fz save / bare dcp.save {ratio:.2f}x (median of "
                  f"per-repeat ratios); fz save with sha256 manifest {med(r['save_sha256']):.3f} s "
                  f"(default: {med(r['save']):.3f} s)\n  per repeat: fz save {_list(r['save'])}; "
                  f"bare dcp.save {_list(r['dcp_only'])}; cold restore {_list(r['restore_cold'])}")
    if cons is not None:
        print(f"\nfz consolidate (one process): {cons['seconds']:.2f} s wall incl. interpreter start and checksum "
              f"pass, peak RSS {cons['peak_mb']:.0f} MB vs {cons['base_mb']:.0f} MB for `import torch, fz` "
              f"(largest tensor {cons['largest_mb']:.1f} MB)")
    shutil.rmtree(args.dir, ignore_errors=True)


def _child_rss(cmd) -> tuple:
    probe = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
             "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
             "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    seconds, kb = out.stdout.split()[-2:]
    return float(seconds), int(kb) / 1024


def consolidate_cost(ckpt: str, directory: str) -> dict:
    """Wall time and peak RSS of `fz consolidate` in a fresh process, and the import-only baseline."""
    from fz.ckpt.layout import resolve
    from fz.ckpt.reader import CheckpointReader
    r = CheckpointReader(resolve(ckpt))
    largest = max(m.size.numel() * m.properties.dtype.itemsize for k, m in r.meta.items() if k.startswith("model/"))
    _, base = _child_rss([sys.executable, "-c", "import torch, fz"])
    seconds, peak = _child_rss([sys.executable, "-m", "fz.cli", "consolidate", ckpt,
                                os.path.join(directory, "out.safetensors")])
    return {"seconds": seconds, "peak_mb": peak, "base_mb": base, "largest_mb": largest / 2**20}


if __name__ == "__main__":
    main()
