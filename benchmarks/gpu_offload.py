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
    p.add_argument("--variants", default="", help="after the timed steps, steps of each variant with their phases "
                   "timed apart (forward, backward, update; the device synchronised between them), e.g. "
                   "'base;prefetch=0;widen=device;copies=2' (`;` between variants, `,` between settings)")
    p.add_argument("--variant-steps", type=int, default=3, help="steps per variant, the first not counted")
    p.add_argument("--profile", default="", help="a folder: one more step under torch.profiler, its tables "
                   "written there")
    p.add_argument("--snapshot", type=int, default=0, help="one more step with the CUDA allocator's history "
                   "recorded: log this many of the largest blocks alive at its peak (gpu_peak_snapshot.py's replay)")
    return p.parse_args()


def _synced(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def phase_times(state, batch, cuda: bool):
    """One step through fz's phases (fz/step/phases.py), each timed to the device's end."""
    from fz.step.phases import StepInProgress
    t0 = _synced(cuda)
    step = StepInProgress(state, batch, micro_batches=1)
    loss = step.forward(state.spec.loss_fn, batch)
    t1 = _synced(cuda)
    step.backward(loss, last=True)
    t2 = _synced(cuda)
    state, loss = step.finish()
    t3 = _synced(cuda)
    return state, float(loss), (t1 - t0, t2 - t1, t3 - t2)


def run_variants(state, batch, text: str, steps: int, cuda: bool) -> tuple[object, dict]:
    """Each variant's median step and phases: Spec fields (prefetch=0) or the switches of
    fz.offload.host_grads (widen=device, copies=2) and fz.offload.transfer
    (streams=2: uploads and downloads on streams of their own), set for its steps only."""
    from fz.offload import host_grads, transfer
    out, base_spec = {}, state.spec
    saved = (host_grads.WIDEN, host_grads.MAX_COPIES, transfer.SPLIT_DIRECTIONS)
    try:
        return _variants(state, batch, text, steps, cuda, out, base_spec)
    finally:
        host_grads.WIDEN, host_grads.MAX_COPIES, transfer.SPLIT_DIRECTIONS = saved


def _variants(state, batch, text: str, steps: int, cuda: bool, out: dict, base_spec) -> tuple[object, dict]:
    import dataclasses

    from fz.offload import host_grads, transfer
    saved = (host_grads.WIDEN, host_grads.MAX_COPIES, transfer.SPLIT_DIRECTIONS)
    for variant in [v.strip() for v in text.split(";") if v.strip()]:
        spec_changes = {}
        for setting in [x for x in variant.split(",") if "=" in x]:
            key, value = (x.strip() for x in setting.split("=", 1))
            if key == "widen":
                host_grads.WIDEN = value
            elif key == "copies":
                host_grads.MAX_COPIES = int(value)
            elif key == "streams":
                transfer.SPLIT_DIRECTIONS = value == "2"
            else:
                spec_changes[key] = int(value)
        state = state.replace(spec=dataclasses.replace(base_spec, **spec_changes))
        rows = []
        try:
            for _ in range(steps):
                state, loss, phases = phase_times(state, batch, cuda)
                rows.append((sum(phases), *phases, loss))
                log.info("variant %s: step %.3f s (forward %.3f, backward %.3f, update %.3f), loss %.4f",
                         variant, *rows[-1])
        except Exception as e:  # the state went with the failed step: no later variant can run
            log.exception("variant %s failed", variant)
            out[variant] = {"error": f"{type(e).__name__}: {e}"}
            return None, out
        kept = rows[1:] or rows
        out[variant] = {k: statistics.median(r[i] for r in kept)
                        for i, k in enumerate(("step_s", "forward_s", "backward_s", "update_s"))}
        out[variant]["losses"] = [r[4] for r in rows]
        host_grads.WIDEN, host_grads.MAX_COPIES, transfer.SPLIT_DIRECTIONS = saved
    return state.replace(spec=base_spec), out


def profile_step(state, batch, folder: str, cuda: bool):
    """One step under torch.profiler: tables by host time and by device time, and the trace."""
    import gzip
    import os

    from torch.profiler import ProfilerActivity, profile
    os.makedirs(folder, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        state, _ = fz_step(state, batch, cuda)
    avg = prof.key_averages()
    with open(os.path.join(folder, "profile_tables.txt"), "w") as f:
        f.write(avg.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
        if cuda:
            f.write(avg.table(sort_by="self_cuda_time_total" if hasattr(avg[0], "self_cuda_time_total")
                              else "self_device_time_total", row_limit=30) + "\n")
    trace = os.path.join(folder, "trace.json")
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        dst.write(src.read())
    os.remove(trace)
    return state


def snapshot_step(state, batch, top: int):
    """One step with the allocator's history recorded; its peak's largest live blocks, logged."""
    from gpu_peak_snapshot import block_line, by_site, peak_blocks
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    state, _ = fz_step(state, batch, True)
    torch.cuda.synchronize()
    peak, alive = peak_blocks(torch.cuda.memory._snapshot(), None)
    blocks = alive[:top]
    torch.cuda.memory._record_memory_history(enabled=None)
    log.info("snapshot step: max_memory_allocated %.2f GB (%.2f GB above the %.2f GB before it); replayed peak "
             "%.2f GB above the recording's start; its largest blocks:", torch.cuda.max_memory_allocated() / 2**30,
             (torch.cuda.max_memory_allocated() - base) / 2**30, base / 2**30, peak / 2**30)
    for e in blocks:
        log.info("  %s", block_line(e))
    log.info("the peak's %d blocks by where they were made:", len(alive))
    for site, nbytes, count in by_site(alive)[:2 * top]:
        log.info("  %8.1f MB in %4d blocks  %s", nbytes / 2**20, count, site)
    return state


def fz_step(state, batch, cuda: bool):
    import fz
    state, loss = fz.train_step(state, batch)
    return state, float(loss)


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
    log.info("%s", est)
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
    device_peak = (torch.cuda.max_memory_allocated() / 2**30) if cuda else None
    host_peak = hwm() / 2**30  # the timed steps' own: the variants below may differ
    variants = {}
    batch = data[:a.micro].to(state.plan.device)
    if a.profile:
        try:
            state = profile_step(state, batch, a.profile, cuda)
        except Exception as e:  # the profiler is a diagnosis: its failure is not the benchmark's
            log.warning("profile failed: %s: %s", type(e).__name__, e)
            state = None  # if it failed inside the step, the state went with it
    if a.snapshot and cuda and state is not None:
        state = snapshot_step(state, batch, a.snapshot)
    if a.variants and state is not None:  # last: a variant that fails takes the state with it
        state, variants = run_variants(state, batch, a.variants, a.variant_steps, cuda)
    out = dict(impl="fz", torch=torch.__version__, device=torch.cuda.get_device_name(0) if cuda else "cpu",
               params=n, model_states_gb=est.model_states / 2**30, losses=losses, step_times_s=times,
               median_step_s=median, tokens_per_s=a.micro * a.seq / median, init_s=init_s,
               device_peak_gb=device_peak, host_peak_gb=host_peak, init_host_peak_gb=init_host_peak / 2**30,
               same_batch=a.same_batch,
               estimate_device_gb=est.per_device / 2**30, estimate_host_gb=est.per_rank_host / 2**30,
               device_cap_gb=a.device_gb, stage=a.stage, offload=a.offload, micro=a.micro, seq=a.seq,
               variants=variants)
    if cuda and hasattr(torch.cuda, "host_memory_stats"):  # pinned memory torch's host allocator holds
        stats = torch.cuda.host_memory_stats()
        out["pinned_allocator"] = {k: v / 2**30 for k, v in stats.items()
                                   if k in ("allocated_bytes.current", "reserved_bytes.current", "allocated_bytes.peak",
                                            "reserved_bytes.peak")}
    out["host_rss_end_gb"] = rss() / 2**30
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
