"""Time gloo's collectives against fz's replacements on one bucket-sized tensor.

On gloo fz runs reduce-scatter as a pairwise exchange and all-gather as one broadcast per
rank (fz/sharding/comm.py), and ranks of one host share memory instead (fz/distributed/shm.py);
this shows why, at each world size asked for. The median of 8 timed calls per kind, slowest
rank, barrier to completion.

    OMP_NUM_THREADS=1 python benchmarks/collectives.py --world 2,4 --numel 5000000
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(rank: int, world: int, numel: int) -> dict:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from fz.compat import all_gather_single, reduce_scatter_single
    from fz.distributed import shm
    from fz.sharding.comm import Comm

    torch.set_num_threads(1)
    plan = SimpleNamespace(shard_group=dist.group.WORLD, shards=world, shard_rank=rank, replica_group=None,
                           replicas=1, shard_ranks=tuple(range(world)), device=torch.device("cpu"))
    os.environ["FZ_COLLECTIVES"] = "pairwise"
    comm = Comm(plan)
    os.environ["FZ_COLLECTIVES"] = "auto"
    shm.open_link(dist.group.WORLD, tuple(range(world)), rank, 4 * numel)
    shared = Comm(plan)
    x = torch.randn(numel - numel % world)
    shard = x.view(world, -1)[rank].clone()
    out = torch.empty_like(shard)
    full = torch.empty_like(x)
    kinds = {
        "all_reduce (gloo)": lambda: dist.all_reduce(x),
        "all_reduce (fz: shared memory)": lambda: shared.all_reduce_sum(x),
        "reduce_scatter (gloo)": lambda: reduce_scatter_single(out, x),
        "reduce_scatter (fz: pairwise exchange)": lambda: comm.reduce_scatter(out, x),
        "reduce_scatter (fz: shared memory)": lambda: shared.reduce_scatter(out, x),
        "all_gather (gloo)": lambda: all_gather_single(full, shard),
        "all_gather (fz: broadcasts)": lambda: comm.all_gather(full, shard),
        "all_gather (fz: shared memory)": lambda: shared.all_gather(full, shard),
    }
    times = {}
    for name, fn in list(kinds.items()) * 2:  # the second round is the one kept
        ts = []
        for _ in range(10):
            dist.barrier()
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        t = torch.tensor(statistics.median(ts[2:]))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[name] = float(t)
    return times


def main() -> None:
    from fz.testing.spawn import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", default="2,4", help="comma list of world sizes")
    p.add_argument("--numel", type=int, default=5_000_000, help="fp32 elements (the 5M-parameter GPT's gradients)")
    args = p.parse_args()
    print(f"fp32 tensor of {args.numel:,} elements ({args.numel * 4 / 1e6:.0f} MB), gloo, 1 thread per rank")
    for world in (int(w) for w in args.world.split(",")):
        times = run_ranks(world, _worker, args.numel, timeout=300)[0]
        print(f"\nworld {world}\n\n| collective | ms |\n|---|---:|")
        for name, t in times.items():
            print(f"| {name} | {1e3 * t:.1f} |")


if __name__ == "__main__":
    main()
