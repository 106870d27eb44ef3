"""Step time, peak RSS and bytes sent of fz stages 0-3 against DDP, FSDP2 and DeepSpeed, world 2 on CPU (gloo).

    OMP_NUM_THREADS=1 /work/venv/bin/python benchmarks/step.py --precision fp32,bf16 --repeats 5 --with-deepspeed
    OMP_NUM_THREADS=1 /work/venv/bin/python benchmarks/step.py --engines floor,ddp,fz0 --steps 12 --warmup 4
    OMP_NUM_THREADS=1 /work/venv/bin/python benchmarks/step.py --world 4 --shard-group 2 \
        --engines fz3,fz3-hsdp,fsdp2,fsdp2-hsdp --repeats 3          # hybrid sharding, bytes across groups
    ... --baseline /path/to/other/checkout                          # each fz engine also from there, interleaved

Every engine trains the same GPT (same initial weights, AdamW lr 1e-3 betas (0.9, 0.999) eps 1e-8
wd 0.01, clip 1.0, lm_loss) on the same per-rank synthetic tokens, in each `--precision`:
fp32, or bf16 = torch.autocast(cpu, bfloat16) for DDP and `floor`, MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32) for FSDP2, precision="bf16" for fz and DeepSpeed's "bf16": {"enabled": true}.
`floor` is rank 0's micro-batches in ONE process (world 1, plain model + torch AdamW, no
communication): the time a step would take if communication were free.

Each engine run is a fresh group of `--world` processes, so one engine's peak RSS (VmHWM) does
not leak into another's. With `--repeats R` every repeat runs all engines (in reverse order on odd
repeats, so a drift in machine load does not favour the engines that run first); because the
machine is noisy, ratios are per repeat (engine / DDP of the same repeat and precision) and the
table shows their median over repeats. Step time is the median over steps [warmup, steps) of the
slowest rank, timed from a barrier to `float(loss)`. "sent MB" is measured on every engine: the
median per-step growth of the rank's /proc/self/io wchar (gloo sends with writev), max over ranks;
for fz, `fz.comm_report` gives its own count (payload bytes times the ring factor).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (
    ROOT,
    base_table,
    bytes_written,
    finish,
    git_state,
    gpt_config,
    launch,
    load_average,
    markdown,
    median,
    report,
    rss_mb,
    source_hash,
    summarize,
    table,
    targets,
    tcp_sent_by_peer,
)

PEERS = ["floor", "ddp", "fsdp2", "fsdp2-noreshard", "fsdp2-hsdp"]
# fz3-keep: live_buckets with room for every block (DeepSpeed's default);
# *-hsdp: shard within --shard-group ranks, replicate across groups (not run by default)
FZ = ["fz0", "fz1", "fz2", "fz3", "fz3-keep", "fz3-hsdp"]
DS = ["ds0", "ds1", "ds2", "ds3"]
ENGINES = PEERS + FZ + DS
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default=",".join(e for e in PEERS + FZ if not e.endswith("-hsdp")),
                   help=f"comma list from {ENGINES} (ds* are added by --with-deepspeed)")
    p.add_argument("--precision", default="fp32", help="comma list from fp32, bf16")
    p.add_argument("--with-deepspeed", action="store_true", help="add DeepSpeed ZeRO stages 0-3 (ds0..ds3)")
    p.add_argument("--params", type=float, default=5e6, help="target model size (parameters)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=25, help="steps per run, warmup included")
    p.add_argument("--warmup", type=int, default=5, help="leading steps left out of the median")
    p.add_argument("--repeats", type=int, default=1, help="interleaved runs of every engine")
    p.add_argument("--world", type=int, default=2, help="ranks per engine run (floor: always 1)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is killed")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed steps, profile 3 more on rank 0 and print its top N ops")
    p.add_argument("--meta-init", action="store_true",
                   help="fz engines only: build the model on the meta device (fz.init materialises its own rows)")
    p.add_argument("--shard-group", type=int, default=0, metavar="N",
                   help="hybrid sharding: *-hsdp engines shard within groups of N ranks; every engine reports the "
                        "bytes crossing those groups (measured per TCP connection with ss)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="another fz checkout: every fz engine also runs from it as '<engine>@base', interleaved")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one rank
    p.add_argument("--worker-precision", default="fp32", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if any(e.endswith("-hsdp") for e in args.engines.split(",")) and args.shard_group < 1:
        p.error("the *-hsdp engines need --shard-group N")
    if args.steps <= args.warmup:
        p.error("--steps must be larger than --warmup")
    args.precisions = [x.strip() for x in args.precision.split(",") if x.strip()]
    if not args.precisions or set(args.precisions) - {"fp32", "bf16"}:
        p.error("--precision takes a comma list of fp32, bf16")
    return args


# ----------------------------------------------------------------------------- worker (one rank)

def deepspeed_error() -> str | None:
    """None if DeepSpeed imports here, else why not (the exact error)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        return f"{type(e).__name__}: {e}"
    return None


def build_step(engine: str, precision: str, model, lm_loss):
    """Returns (step(batch) -> loss tensor, fz state box or None) for one engine, after wrapping `model`."""
    import contextlib

    import torch

    bf16 = precision == "bf16"

    def eager(module, params, autocast: bool):
        opt = torch.optim.AdamW(params, **ADAMW)
        ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

        def step(batch):
            opt.zero_grad(set_to_none=True)
            with ctx():
                loss = lm_loss(module, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            opt.step()
            return loss.detach()
        return step, None

    if engine == "floor":
        return eager(model, model.parameters(), bf16)
    if engine == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return eager(ddp, ddp.parameters(), bf16)
    group = int(os.environ.get("FZBENCH_SHARD_GROUP", "0"))
    if engine in ("fsdp2", "fsdp2-noreshard", "fsdp2-hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        reshard = engine != "fsdp2-noreshard"
        world = torch.distributed.get_world_size()
        mesh = init_device_mesh("cpu", (world // group, group), mesh_dim_names=("replicate", "shard")) \
            if engine == "fsdp2-hsdp" else None
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        return eager(model, model.parameters(), False)
    if engine.split("@")[0] in FZ:
        engine = engine.split("@")[0]
        import fz
        keep = {"live_buckets": 10**6} if engine.endswith("-keep") else {}
        if engine.endswith("-hsdp"):
            keep = {"shard_group_size": group}
        spec = fz.Spec(stage=int(engine[2]), **keep, optimizer=fz.optim.adamw(**ADAMW), grad_accum=1,
                       clip_grad_norm=1.0, precision=precision, loss_fn=lm_loss, seed=0)
        box = {"state": fz.init(model, spec)}

        def step(batch):
            box["state"], loss = fz.train_step(box["state"], batch)
            return loss
        return step, box
    if engine in DS:
        import deepspeed
        cfg = {"train_micro_batch_size_per_gpu": int(os.environ["FZBENCH_MICRO"]),
               "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]),
                                                         "eps": ADAMW["eps"], "weight_decay": ADAMW["weight_decay"],
                                                         "torch_adam": True}},
               "zero_optimization": {"stage": int(engine[2:])},
               "steps_per_print": 10**9, "wall_clock_breakdown": False}
        if bf16:  # bf16 weights, fp32 master; gradients reduced in fp32 as fz and FSDP2 do
            cfg["bf16"] = {"enabled": True}
            cfg["communication_data_type"] = "fp32"
        eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

        def step(batch):
            loss = lm_loss(eng, batch)
            eng.backward(loss)
            eng.step()
            return loss.detach()
        return step, None
    raise ValueError(f"unknown engine {engine!r}; choose from {ENGINES}")


def profile_steps(step, batches, top: int) -> str:
    """torch.profiler key_averages of `batches` steps (CPU time, self time sorted)."""
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for b in batches:
            float(step(b))
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from fz.testing.gpt import GPT, lm_loss, synthetic_tokens

    engine, precision = args.worker, args.worker_precision
    torch.set_num_threads(1)
    distributed = engine != "floor"
    if engine in DS:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: F401  (imported before the base RSS is taken)
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    base_mb = rss_mb("VmRSS")                  # torch + gloo, before any model memory
    cfg, n_params = gpt_config(int(args.params), args.seq)
    torch.manual_seed(0)                       # same initial weights for every engine and rank
    if args.meta_init and engine.split("@")[0] in FZ:
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    extra = 3 if args.profile else 0
    data = synthetic_tokens((args.steps + extra) * args.micro_batch, cfg.seq, cfg.vocab, seed=1000 + rank)
    os.environ["FZBENCH_MICRO"] = str(args.micro_batch)
    step, box = build_step(engine, precision, model, lm_loss)
    del model  # the wrappers keep it; fz needs it no more after init

    batches = [data[i * args.micro_batch:(i + 1) * args.micro_batch] for i in range(args.steps + extra)]
    times, losses, sent = [], [], []
    pids = [None] * (dist.get_world_size() if distributed else 1)
    if args.shard_group and distributed:
        dist.all_gather_object(pids, os.getpid())
    tcp0 = None
    for i, batch in enumerate(batches[:args.steps]):
        if distributed:
            dist.barrier()
        if args.shard_group and distributed and i == args.warmup:
            tcp0 = tcp_sent_by_peer(os.getpid())
        w0, t0 = bytes_written(), time.perf_counter()
        loss = float(step(batch))
        times.append(time.perf_counter() - t0)
        sent.append(bytes_written() - w0)
        losses.append(loss)
    cross = None
    if tcp0 is not None:  # bytes this rank sent to ranks outside its group, per timed step
        tcp1 = tcp_sent_by_peer(os.getpid())
        mine = rank // args.shard_group
        cross = sum(tcp1.get(p, 0) - tcp0.get(p, 0) for r, p in enumerate(pids)
                    if r // args.shard_group != mine) / (args.steps - args.warmup)
    result = {"rss_mb": rss_mb("VmHWM"), "base_mb": base_mb, "params": n_params, "layers": cfg.layers,
              "dim": cfg.dim, "src": source_hash(args.baseline if engine.endswith("@base") else None)}
    if box is not None:
        import fz
        comm = fz.comm_report(box["state"])
        result["fz_comm"] = {"payload": comm.payload, "sent_total": comm.sent_total,
                             "inter_sent_total": getattr(comm, "inter_sent_total", None)}
        result["fz_memory"] = fz.memory_report(box["state"]).as_dict()
    if args.profile:
        table = profile_steps(step, batches[args.steps:], args.profile)
        if rank == 0:
            result["profile"] = table
    if distributed:  # a step's time is its slowest rank's; losses averaged; RSS and bytes max over ranks
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        s = torch.tensor(sent, dtype=torch.float64)
        dist.all_reduce(s, op=dist.ReduceOp.MAX)
        loss_sum = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        if cross is not None:
            c = torch.tensor([cross], dtype=torch.float64)
            dist.all_reduce(c, op=dist.ReduceOp.MAX)
            result["cross_group"] = c.item()
        m = torch.tensor([result["rss_mb"], base_mb], dtype=torch.float64)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        times, sent, losses = t.tolist(), s.tolist(), (loss_sum / dist.get_world_size()).tolist()
        result["rss_mb"], result["base_mb"] = m.tolist()
    if rank == 0:
        report({**result, "times": times, "sent": sent, "loss": losses})
    finish(dist if distributed else None)


# ----------------------------------------------------------------------------- launcher

def run_one(engine: str, precision: str, args, argv) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", engine, "--worker-precision", precision]
    world = 1 if engine == "floor" else args.world
    env = {"DS_ACCELERATOR": "cpu"} if engine in DS else {}
    env["FZBENCH_SHARD_GROUP"] = str(args.shard_group)
    if engine.endswith("@base"):  # the baseline's fz first on the path; this file's worker and harness
        env = {"PYTHONPATH": os.pathsep.join([os.path.abspath(args.baseline), ROOT])}
    return launch(cmd, world, args.timeout, env)


def cross_table(runs, rows, engines, p) -> str:
    out = []
    for e in engines:
        ok = [r for r in runs[e, p] if "error" not in r]
        cross = median(r.get("cross_group") for r in ok)
        inter = ok[0].get("fz_comm", {}).get("inter_sent_total") if ok else None
        step = rows[e, p].get("step")
        out.append([e, "-" if step is None else f"{1e3 * step:.1f}", "-" if cross is None else f"{cross / 1e6:.2f}",
                    "-" if inter is None else f"{inter / 1e6:.2f}"])
    return markdown(["engine", "step ms", "cross-group MB/step/rank (ss)", "fz comm_report inter MB"], out)


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.with_deepspeed:
        why = deepspeed_error()
        if why is None:
            engines += [e for e in DS if e not in engines]
        else:
            print(f"--with-deepspeed: DeepSpeed cannot run here ({why}); "
                  "install it with DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation deepspeed "
                  "(+ hjson, msgpack, py-cpuinfo, pydantic, psutil, ninja, tqdm); running without it", flush=True)
            engines = [e for e in engines if e not in DS]
    if args.baseline:
        engines += [e + "@base" for e in engines if e in FZ]
    unknown = [e for e in engines if e.removesuffix("@base") not in ENGINES]
    if unknown:
        sys.exit(f"unknown engines {unknown}; choose from {ENGINES}")
    print("$ " + shlex.join(["OMP_NUM_THREADS=1", sys.executable, *sys.argv]), flush=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average at start {load_average()}, "
          f"{git_state()}" + (f"; baseline {args.baseline}: {git_state(args.baseline)}" if args.baseline else ""),
          flush=True)
    t_start = time.monotonic()
    runs = {(e, p): [] for e in engines for p in args.precisions}
    for rep in range(args.repeats):
        order = [(e, p) for p in args.precisions for e in engines]
        for e, p in order if rep % 2 == 0 else order[::-1]:
            t0 = time.monotonic()
            res = run_one(e, p, args, argv)
            runs[e, p].append(res)
            status = res.get("error") or f"{1e3 * median(res['times'][args.warmup:]):.1f} ms"
            status += f"  WARNING: {res['warning']}" if "warning" in res else ""
            print(f"  repeat {rep + 1}/{args.repeats} {p} {e:<16} {status}  ({time.monotonic() - t0:.1f}s, "
                  f"load {load_average()})", flush=True)
            for line in res.get("tail", []):
                print(f"      | {line}", flush=True)
            if res.get("profile"):
                print(f"\n  profile of rank 0, {e} {p}, 3 steps after the timed ones:\n{res['profile']}", flush=True)

    rows = summarize(runs, engines, args.precisions, args)
    meta = next((r["meta"] for r in rows.values() if "meta" in r), None)
    if meta:
        print(f"\nGPT {meta['params'] / 1e6:.2f}M params (dim {meta['dim']}, {meta['layers']} layers), "
              f"seq {args.seq}, micro-batch {args.micro_batch}/rank, world {args.world} (floor: 1 process), "
              f"gloo CPU, median of steps {args.warmup}-{args.steps - 1}, {args.repeats} repeat(s); ratios are "
              f"medians of per-repeat ratios; load average at end {load_average()}")
    sources = {(e.endswith("@base"), r["src"]) for (e, _), rs in runs.items() for r in rs if "src" in r}
    if len(sources) > len({b for b, _ in sources}):
        print(f"WARNING: fz/ sources changed during the run ({len(sources)} versions); rerun")
    for p in args.precisions:
        print(f"\n### {p}\n\n{table(rows, engines, p)}")
        for e in engines:
            comm = rows[e, p].get("meta", {}).get("fz_comm")
            if comm:
                kinds = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(comm["payload"].items()))
                print(f"{'' if e != engines[0] else chr(10)}- {e} fz.comm_report payload MB: {kinds}")
        vs_base = base_table(rows, engines, p)
        if vs_base:
            print(f"\nAgainst the baseline ({p}, median of per-repeat ratios):\n\n{vs_base}")
        if args.shard_group:
            print(f"\nBytes crossing groups of {args.shard_group} ranks ({p}; ss per TCP connection, "
                  f"max over ranks, median over repeats):\n\n" + cross_table(runs, rows, engines, p))
        checks = targets(rows, engines, p)
        if checks:
            print(f"\nTargets ({p}):\n\n" + markdown(["target", "value", "status"], checks))
    print(f"\ntotal wall time {time.monotonic() - t_start:.1f}s")


if __name__ == "__main__":
    main()
