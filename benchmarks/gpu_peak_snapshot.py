"""Where a step's device peak goes: the live allocations at the peak of one fz step on a GPU.

    python3 benchmarks/gpu_peak_snapshot.py                 # the model and batch of gpu_offload.py
    python3 benchmarks/gpu_peak_snapshot.py --dim 512 --layers 4 --heads 8 --vocab 4096 --seq 256

Runs fz.init and one warm-up step, then records the CUDA allocator's history over a second step
(torch.cuda.memory._record_memory_history), replays it to the peak of allocated bytes, and prints
the largest blocks alive there with the fz and torch frames that made them, beside fz.estimate's
terms. Made for the gap gpu_offload.py measured at 2.8B with activation checkpointing (estimate
3.56 GB, max_memory_allocated 6.01 GB; benchmarks/RESULTS.md), which the CPU cannot show.
"""
from __future__ import annotations

import argparse
import logging

import torch
from gpu_common import add_model_args

log = logging.getLogger("fz.bench")


def peak_blocks(snapshot: dict, top: int | None) -> tuple[int, list]:
    """(peak bytes above the recording's start, the `top` largest blocks alive at that peak; None: all)."""
    cur = peak = 0
    live: dict = {}
    at: dict = {}
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            cur += e["size"]
            live[e["addr"]] = e
            if cur > peak:
                peak, at = cur, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            cur -= e["size"]
            del live[e["addr"]]
    return peak, sorted(at.values(), key=lambda e: -e["size"])[:top]


def block_line(e: dict) -> str:
    """A block's size and the fz and torch frames that made it (innermost first, at most 4)."""
    frames = [f for f in e["frames"] if "/fz/" in f["filename"] or "/torch/" in f["filename"]][:4]
    return f"{e['size'] / 2**20:8.1f} MB  " + " < ".join(
        f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames)


def by_site(blocks: list) -> list[tuple[str, int, int]]:
    """The blocks' bytes by where they were allocated (the innermost fz frame, else torch's, else
    '(C++: autograd, kernels)'), largest first: [(site, bytes, blocks)]."""
    sites: dict[str, list[int]] = {}
    for e in blocks:
        frames = [f for f in e["frames"] if "/fz/" in f["filename"]] or \
                 [f for f in e["frames"] if "/torch/" in f["filename"]]
        site = (f"{frames[0]['filename'].rsplit('/', 1)[-1]}:{frames[0]['line']} {frames[0]['name']}" if frames
                else "(C++: autograd, kernels)")
        acc = sites.setdefault(site, [0, 0])
        acc[0] += e["size"]
        acc[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in sites.items()), key=lambda x: -x[1])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = add_model_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--no-act-ckpt", action="store_true")
    p.add_argument("--top", type=int, default=16)
    a = p.parse_args()
    import fz
    from fz.testing.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

    if a.device_gb:
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, a.device_gb * 2**30 / torch.cuda.get_device_properties(0).total_memory)
        )
    cfg = GPTConfig(vocab=a.vocab, seq=a.seq, dim=a.dim, heads=a.heads, layers=a.layers)
    with torch.device("meta"):
        model = GPT(cfg)
    spec = fz.Spec(stage=3, precision="bf16", clip_grad_norm=1.0, loss_fn=lm_loss,
                   offload=fz.offload.cpu(params=True), activation_checkpointing=not a.no_act_ckpt)
    est = fz.estimate(model, spec=spec, micro_batch=a.micro, seq_len=a.seq + 1)
    gb = 2**30
    log.info("estimate: per_device %.2f GB = first op %.2f (activations %.2f) + gather %.2f - summed %.2f; "
             "units' backward %.2f, reduce %.2f", est.per_device / gb, (est.backward_start or 0) / gb,
             (est.activations or 0) / gb, est.gather / gb, est.gather_summed / gb, (est.backward_units or 0) / gb,
             est.reduce / gb)
    state = fz.init(model, spec)
    log.info("after fz.init: peak %.2f GB, allocated %.2f GB", torch.cuda.max_memory_allocated() / gb,
             torch.cuda.memory_allocated() / gb)
    data = synthetic_tokens(a.micro, cfg.seq, cfg.vocab, seed=0)
    for i in range(2):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if i == 1:
            torch.cuda.memory._record_memory_history(max_entries=500_000)
        state, loss = fz.train_step(state, data)
        float(loss)
        torch.cuda.synchronize()
        log.info("step %d: peak %.2f GB above %.2f GB allocated before it", i,
                 (torch.cuda.max_memory_allocated() - base) / gb, base / gb)
    peak, blocks = peak_blocks(torch.cuda.memory._snapshot(), a.top)
    torch.cuda.memory._record_memory_history(enabled=None)
    log.info("replayed peak %.2f GB; its largest blocks:", peak / gb)
    for e in blocks:
        log.info("  %s", block_line(e))


if __name__ == "__main__":
    main()
