"""Checkpoint save/restore time and throughput of fz at world 2, against the disk (dd) and
FSDP2 (fully_shard) + DCP's own save/load of the same model.

    OMP_NUM_THREADS=1 /work/venv/bin/python benchmarks/ckpt.py --dir /tmp/fz_ckpt_bench --repeats 5

State bytes = parameters + AdamW moments (12 bytes per parameter, fp32), ~100 MB by default.
Every time is the slowest rank's, barrier to barrier, median over `--repeats`. MB/s is state
MB / time. Restores read from the page cache (just written); saves fsync every file.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def dd_bandwidth(directory: str, mb: int = 256) -> dict:
    """MB/s of `dd` writing `mb` MiB to `directory`: O_DIRECT, and buffered + fdatasync."""
    out = {}
    path = os.path.join(directory, "dd.bin")
    for name, flag in (("oflag=direct", "oflag=direct"), ("conv=fdatasync", "conv=fdatasync")):
        res = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}", flag],
                             capture_output=True, text=True)
        m = re.search(r"copied, ([\d.]+) s", res.stderr)
        out[name] = mb * 2**20 / 1e6 / float(m.group(1)) if m else float("nan")
        os.unlink(path)
    return out


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
    import torch.distributed.checkpoint as dcp

    import fz
    from fz.ckpt import manifest, restore, save, wait_for_checkpoints
    from fz.ckpt.tree import entries
    from fz.testing.gpt import lm_loss, synthetic_tokens
    spec = fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=1e-3), loss_fn=lm_loss)
    state = fz.init(_model(cfg), spec)
    state, _ = fz.train_step(state, synthetic_tokens(2, cfg.seq, cfg.vocab, seed=rank))
    root = os.path.join(directory, f"fz{stage}")
    res = {k: [] for k in ("save", "async_return", "async_total", "restore", "dcp_only", "save_sha256")}
    for i in range(repeats):
        res["save"].append(_timed(lambda: save(state, root, step=100 + i, keep_last=2)))
        t = time.perf_counter()
        ret = _timed(lambda: save(state, root, step=200 + i, keep_last=2, async_=True))
        wait_for_checkpoints()
        res["async_return"].append(ret)
        res["async_total"].append(time.perf_counter() - t)
        fresh = fz.init(_model(cfg), spec)
        res["restore"].append(_timed(lambda: restore(fresh, root)))
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/fz_ckpt_bench", help="where checkpoints (and dd) write")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stages", default="0,3")
    args = p.parse_args()
    from fz.testing.gpt import GPTConfig
    from fz.testing.spawn import run_ranks
    cfg = GPTConfig(vocab=4096, seq=64, dim=512, heads=8, layers=2)  # 8.4M params: 101 MB with AdamW
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    dd = dd_bandwidth(args.dir)
    rows = []
    for stage in map(int, args.stages.split(",")):
        r = run_ranks(args.world, _fz, cfg, args.dir, args.repeats, stage, timeout=900)[0]
        rows.append((f"fz stage {stage}", r))
    rows.append(("FSDP2 + dcp", run_ranks(args.world, _fsdp2, cfg, args.dir, args.repeats, timeout=900)[0]))
    cons = consolidate_cost(os.path.join(args.dir, f"fz{args.stages.split(',')[-1]}"), args.dir)
    mb = rows[0][1]["bytes"] / 1e6
    med = statistics.median
    print(f"state: {mb:.1f} MB (params + AdamW moments), world {args.world}, {args.repeats} repeats, dir {args.dir}")
    print(f"dd 256 MiB: oflag=direct {dd['oflag=direct']:.0f} MB/s, conv=fdatasync {dd['conv=fdatasync']:.0f} MB/s\n")
    print("| engine | save s | save MB/s | async returns s | async total s | restore s | restore MB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        s, a, at, rs = (med(r[k]) for k in ("save", "async_return", "async_total", "restore"))
        print(f"| {name} | {s:.3f} | {mb / s:.0f} | {a:.3f} | {at:.3f} | {rs:.3f} | {mb / rs:.0f} |")
    for name, r in rows:
        if "dcp_only" in r:
            print(f"\n{name}: bare dcp.save of the same tensors {med(r['dcp_only']):.3f} s; "
                  f"fz save with sha256 manifest {med(r['save_sha256']):.3f} s (crc32: {med(r['save']):.3f} s)")
    print(f"\nfz consolidate (one process): {cons['seconds']:.2f} s wall incl. interpreter start and checksum pass, "
          f"peak RSS {cons['peak_mb']:.0f} MB vs {cons['base_mb']:.0f} MB for `import torch, fz` "
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
