"""Generate: tokens/s of fz.generate at world 2, stage 3 ("gather" once per call, and "stream"
every unit per forward), against HF's generate on a DeepSpeed ZeRO-3 engine (gloo, CPU,
synced_gpus=True) and HF's plain generate on the whole model at world 1.

    OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/generate.py --ds-python /work/venv-ds/bin/python

The model: GPT-2 (transformers' GPT2LMHeadModel) with 12 layers of width 768 and a 32000-token
vocabulary, about 110M parameters, random weights from a fixed seed, fp32. Prompts of 16 tokens,
batch 1 and 8; every sequence generates exactly `--new` tokens (min_new_tokens = max_new_tokens,
greedy). Each engine is a fresh group of processes (benchmarks/_harness.launch); within it one
short warm-up generate, then `--repeats` timed ones (the median is reported). tokens/s counts the
new tokens of the whole batch on one rank (every rank generates its own batch of that size).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import finish, git_state, launch, load_average, markdown, median, report, rss_mb

ENGINES = ["fz3-gather", "fz3-stream", "ds3", "hf1"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ds-python", default="/work/venv-ds/bin/python", help="a Python with deepspeed (for ds3)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def model():
    """About 110M parameters, GPT-2's shape with a 32000-token vocabulary; no eos ends a sequence early."""
    import torch
    import transformers as tr
    torch.manual_seed(0)
    cfg = tr.GPT2Config(vocab_size=32000, n_positions=256, n_embd=768, n_layer=12, n_head=12,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, eos_token_id=1)
    return tr.GPT2LMHeadModel(cfg).eval()


def prompts(batch: int, length: int, rank: int):
    import torch
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(3, 32000, (batch, length), generator=g)
    return ids, torch.ones_like(ids)


def worker(args) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    engine, world = args.worker, int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    m = model()
    params = sum(p.numel() for p in m.parameters())
    kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
    if engine.startswith("fz"):
        import fz
        fz.distributed.init()
        state = fz.init(m, fz.Spec(stage=3))
        residency = engine.split("-")[1]
        run = lambda ids, mask, **k: fz.generate(state, ids, mask, residency=residency, **k)  # noqa: E731
    elif engine == "ds3":
        import deepspeed
        dist.init_process_group("gloo")
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                  "steps_per_print": 10**9}
        ds_engine = deepspeed.initialize(model=m, config=config)[0]
        ds_engine.module.eval()
        run = lambda ids, mask, **k: ds_engine.module.generate(ids, attention_mask=mask, synced_gpus=True, **k)  # noqa: E731
    else:  # hf1: the whole model on one process
        run = lambda ids, mask, **k: m.generate(ids, attention_mask=mask, **k)  # noqa: E731
    out = {"engine": engine, "world": world, "params": params, "times": {}, "torch": torch.__version__}
    with torch.no_grad():
        for batch in [int(b) for b in args.batches.split(",")]:
            ids, mask = prompts(batch, args.prompt, rank)
            run(ids, mask, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
            times = []
            for _ in range(args.repeats):
                if dist.is_initialized():
                    dist.barrier()
                t0 = time.perf_counter()
                got = run(ids, mask, **kw)
                times.append(time.perf_counter() - t0)
                assert got.shape == (batch, args.prompt + args.new), got.shape
            out["times"][batch] = times
    out["rss_mb"] = rss_mb()
    if rank == 0:
        report(out)
    finish(dist)


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    here = os.path.abspath(__file__)
    argv = ["--batches", args.batches, "--new", str(args.new), "--prompt", str(args.prompt),
            "--repeats", str(args.repeats)]
    results = {}
    for e in args.engines.split(","):
        python = args.ds_python if e == "ds3" else sys.executable
        env = {"DS_ACCELERATOR": "cpu"} if e == "ds3" else None
        t0 = time.monotonic()
        results[e] = launch([python, here, *argv, "--worker", e], 1 if e == "hf1" else 2, args.timeout, env)
        print(f"{e}: {time.monotonic() - t0:.0f}s {results[e]}", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for e, r in results.items():
        if "error" in r:
            rows.append([e, "-", *["error: " + r["error"]] * len(batches), "-"])
            continue
        tps = [args.new * b / median(r["times"][str(b)]) for b in batches]
        rows.append([e, str(r["world"]), *[f"{t:.1f}" for t in tps], f"{r['rss_mb']:.0f}"])
    ref = results.get("ds3", {})
    ratios = []
    for e in ("fz3-gather", "fz3-stream"):
        r = results.get(e, {})
        if "error" in r or "error" in ref or not r or not ref:
            continue
        ratios.append(f"{e} / ds3: " + ", ".join(
            f"batch {b} {median(ref['times'][str(b)]) / median(r['times'][str(b)]):.1f}x" for b in batches))
    params = next((r["params"] for r in results.values() if "params" in r), 0)
    print(f"\n{datetime.date.today()}, {git_state()}, {platform.node()} ({os.cpu_count()} CPUs), "
          f"load {load_average()}; GPT-2 {params / 1e6:.0f}M params, fp32, prompt {args.prompt}, "
          f"{args.new} new tokens, median of {args.repeats}")
    print(markdown(["engine", "world", *[f"tokens/s batch {b}" for b in batches], "peak RSS MB (rank 0)"], rows))
    for line in ratios:
        print(line)


if __name__ == "__main__":
    main()
