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
import resource
import statistics
import time

import torch

log = logging.getLogger("fz.bench")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=2560)
    p.add_argument("--layers", type=int, default=34)
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="steps, the first one a warm-up")
    p.add_argument("--device-gb", type=float, default=24.0, help="cap on the device's memory (0: none)")
    p.add_argument("--offload", default="params", choices=["params", "optimizer", "none"])
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--same-batch", action="store_true", help="every step on the first batch (the loss then "
                   "measures fitting alone, not the batches' own differences)")
    return p.parse_args()


def _hwm() -> int:
    """Peak resident bytes since the last reset (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: resets VmHWM to the current RSS
    except OSError:
        log.warning("could not reset the peak RSS: host_peak_gb includes fz.init's")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = parse_args()
    import fz
    from fz.testing.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

    cuda = torch.cuda.is_available()
    if cuda and a.device_gb:
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.device_gb * 2**30 / torch.cuda.get_device_properties(0).total_memory))
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
    init_host_peak = _hwm()
    _reset_hwm()  # the host peak below is the training steps' own
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
               host_peak_gb=_hwm() / 2**30, init_host_peak_gb=init_host_peak / 2**30, same_batch=a.same_batch,
               estimate_device_gb=est.per_device / 2**30, estimate_host_gb=est.per_rank_host / 2**30,
               device_cap_gb=a.device_gb, stage=a.stage, offload=a.offload, micro=a.micro, seq=a.seq)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
