"""Seed 000's promise on one GPU: a GPT of T0_3B's size trained with ZeRO-3 and parameters and
optimizer offloaded to the CPU, the device capped at 24 GB.

    python3 benchmarks/gpu_offload.py                       # 2.8B parameters (dim 2560, 34 layers)
    python3 benchmarks/gpu_offload.py --dim 256 --layers 2 --vocab 512 --seq 64 --steps 2   # a smoke run

Prints a line per step and one `RESULT {json}` line: losses, step times, tokens/s, the device
peak (torch.cuda.max_memory_allocated) and the host peak (peak RSS), with fz.estimate's
prediction of both. benchmarks/gpu_offload_deepspeed.py runs DeepSpeed on the same model and batch.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch
from gpu_common import add_model_args, hwm, reset_hwm, rss

log = logging.getLogger("fz.bench")


def parse_args():
    p = add_model_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--offload", default="params", choices=["params", "optimizer", "none"])
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4)
    return p.parse_args()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = parse_args()
    import fz
    from fz.testing.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

    cuda = torch.cuda.is_available()
    if cuda and a.device_gb:
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, a.device_gb * 2**30 / torch.cuda.get_device_properties(0).total_memory)
        )
    cfg = GPTConfig(vocab=a.vocab, seq=a.seq, dim=a.dim, heads=a.heads, layers=a.layers)
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    policy = {"params": fz.offload.cpu(params=True), "optimizer": fz.offload.cpu(), "none": None}[a.offload]
    spec = fz.Spec(stage=a.stage, precision="bf16", optimizer=fz.optim.adamw(lr=a.lr), clip_grad_norm=1.0,
                   loss_fn=lm_loss, offload=policy, activation_checkpointing=True)
    est = fz.estimate(model, spec=spec, micro_batch=a.micro, seq_len=a.seq + 1)
    log.info("%.2fB parameters, model states %.1f GB; estimate: device %.2f GB, host %.2f GB",
             n / 1e9, est.model_states / 2**30, est.per_device / 2**30, est.per_rank_host / 2**30)
    t0 = time.perf_counter()
    state = fz.init(model, spec)
    init_s = time.perf_counter() - t0
    log.info("fz.init %.1f s; %s", init_s, fz.memory_report(state))
    init_host_peak = hwm()
    if not reset_hwm():
        log.warning("could not reset the peak RSS: host_peak_gb includes fz.init's")
    # the host peak below is the training steps' own
    data = synthetic_tokens(a.micro * a.steps, a.seq, a.vocab, seed=0)
    losses, times = [], []
    for i in range(a.steps):
        t = time.perf_counter()
        j = 0 if a.same_batch else i
        state, loss = fz.train_step(state, data[j * a.micro:(j + 1) * a.micro])
        losses.append(float(loss))  # waits for the step
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        log.info("step %d  loss %.4f  %.2f s", i, losses[-1], times[-1])
    median = statistics.median(times[1:] or times)
    out = dict(impl="fz", torch=torch.__version__, device=torch.cuda.get_device_name(0) if cuda else "cpu",
               params=n, model_states_gb=est.model_states / 2**30, losses=losses, step_times_s=times,
               median_step_s=median, tokens_per_s=a.micro * a.seq / median, init_s=init_s,
               device_peak_gb=(torch.cuda.max_memory_allocated() / 2**30) if cuda else None,
               host_peak_gb=hwm() / 2**30, init_host_peak_gb=init_host_peak / 2**30, same_batch=a.same_batch,
               estimate_device_gb=est.per_device / 2**30, estimate_host_gb=est.per_rank_host / 2**30,
               device_cap_gb=a.device_gb, stage=a.stage, offload=a.offload, micro=a.micro, seq=a.seq)
    if cuda and hasattr(torch.cuda, "host_memory_stats"):  # pinned memory torch's host allocator holds
        stats = torch.cuda.host_memory_stats()
        out["pinned_allocator"] = {k: v / 2**30 for k, v in stats.items()
                                   if k in ("allocated_bytes.current", "reserved_bytes.current", "allocated_bytes.peak",
                                            "reserved_bytes.peak")}
    out["host_rss_end_gb"] = rss() / 2**30
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
