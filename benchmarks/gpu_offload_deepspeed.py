"""DeepSpeed's ZeRO-3 Offload on the model and batch of benchmarks/gpu_offload.py, for comparison.

One GPU, ZeRO stage 3, parameters and optimizer offloaded to pinned CPU memory, bf16,
DeepSpeedCPUAdam (AdamW mode), gradient clipping at 1.0, activation checkpointing on each block,
the model built under deepspeed.zero.Init so it never lies whole on the device, the device capped.

    python3 benchmarks/gpu_offload_deepspeed.py                       # 2.8B parameters (dim 2560, 34 layers)
    python3 benchmarks/gpu_offload_deepspeed.py --dim 256 --layers 2 --heads 4 --vocab 512 --seq 64 --steps 2

Needs DeepSpeed (benchmarks/gpu_run.sh installs it from .whl/); its CPU Adam op is JIT-compiled on
first use (ninja and a C++ compiler, about a minute, outside the timed steps). Runs as a plain
`python3`: it sets up a one-process group itself. Prints a line per step and one `RESULT {json}`
line; any failure prints `RESULT {"impl": "deepspeed", "error": ...}` and still exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import sys
import time
import traceback

from gpu_common import add_model_args, hwm, reset_hwm, rss


def parse_args(argv=None):
    p = add_model_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--optimizer", default="cpuadam", choices=["cpuadam", "torch"],
                   help="cpuadam: DeepSpeedCPUAdam (falls back to torch.optim.AdamW, and says so in RESULT, "
                   "if its op cannot be built); torch: torch.optim.AdamW on the CPU partitions")
    p.add_argument("--no-act-ckpt", action="store_true", help="no activation checkpointing")
    p.add_argument("--stage", type=int, default=3, choices=[2, 3],
                   help="3: parameters and optimizer on the CPU (the headline); 2: the optimizer only")
    p.add_argument("--phase-steps", type=int, default=0, help="after the timed steps, this many more with forward, "
                   "backward and step timed apart (the device synchronised between them)")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env() -> None:
    """What a launcher would set, for a plain `python3` run as rank 0 of 1."""
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())


def _checkpoint_blocks(model) -> int:
    """Activation checkpointing on each block: fz's GPT has no hook for it, so wrap each block's forward.

    The block's own __call__ (and so ZeRO-3's hooks on the block) runs outside; its submodules' hooks
    run again in the recompute, which fetches their partitioned parameters anew.
    """
    import torch.utils.checkpoint as ckpt

    def wrap(fwd):
        def forward(x):
            return ckpt.checkpoint(fwd, x, use_reentrant=False)
        return forward

    for blk in model.blocks:
        blk.forward = wrap(blk.forward)
    return len(model.blocks)


def run(a) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: this benchmark runs DeepSpeed on a GPU")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_device(0)
    if a.device_gb:  # before anything is allocated on the device
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.device_gb * 2**30 / total), 0)

    _single_process_env()
    os.environ.setdefault("DS_ACCELERATOR", "cuda")
    os.environ.setdefault("DS_SKIP_CUDA_CHECK", "1")  # only the CPU Adam op is built, and it needs no nvcc
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from fz.testing.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

    t_start = time.perf_counter()
    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)

    zero = {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": True},
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        # DeepSpeed's defaults, written out so the RESULT line records them
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": int(5e8),
        "stage3_prefetch_bucket_size": int(5e7),
        "stage3_param_persistence_threshold": int(1e5),
        "stage3_max_live_parameters": int(1e9),
        "stage3_max_reuse_distance": int(1e9),
        "sub_group_size": int(1e9),
    }
    if a.stage == 2:  # the optimizer alone on the CPU: stage 2's keys (and defaults) only
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                "contiguous_gradients": True, "reduce_bucket_size": int(5e8), "allgather_bucket_size": int(5e8)}
    ds_config = {
        "train_micro_batch_size_per_gpu": a.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }

    cfg = GPTConfig(vocab=a.vocab, seq=a.seq, dim=a.dim, heads=a.heads, layers=a.layers)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=ds_config) if a.stage == 3 else contextlib.nullcontext():
        model = GPT(cfg)
    zero_init_s = time.perf_counter() - t0
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # unique: the head is tied
    print(f"{n / 1e9:.2f}B parameters; built under zero.Init in {zero_init_s:.1f} s; "
          f"device {torch.cuda.memory_allocated() / 2**30:.2f} GB allocated", flush=True)
    ckpt_blocks = 0 if a.no_act_ckpt else _checkpoint_blocks(model)

    optimizer_name, fallback = None, None
    t0 = time.perf_counter()
    if a.optimizer == "cpuadam":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            optimizer = DeepSpeedCPUAdam(model.parameters(), lr=a.lr, weight_decay=a.weight_decay, adamw_mode=True)
            optimizer_name = "DeepSpeedCPUAdam(adamw_mode=True)"
        except Exception as e:  # the op's JIT build failed: say so, and go on with torch's
            fallback = f"DeepSpeedCPUAdam failed: {type(e).__name__}: {str(e)[:300]}"
            print("WARNING " + fallback + "; falling back to torch.optim.AdamW", flush=True)
    if optimizer_name is None:
        ds_config["zero_force_ds_cpu_optimizer"] = False
        optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
        optimizer_name = "torch.optim.AdamW" + (" (fallback)" if fallback else "")
    optimizer_s = time.perf_counter() - t0
    print(f"optimizer {optimizer_name} ready in {optimizer_s:.1f} s (includes the op's JIT build)", flush=True)

    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    initialize_s = time.perf_counter() - t0
    init_s = time.perf_counter() - t_start
    print(f"deepspeed.initialize {initialize_s:.1f} s; init in all {init_s:.1f} s; "
          f"device {torch.cuda.memory_allocated() / 2**30:.2f} GB allocated", flush=True)

    init_host_peak = max(hwm(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    hwm_reset = reset_hwm()  # train_host_peak_gb below is the steps' own, as fz's host_peak_gb

    data = synthetic_tokens(a.micro * a.steps, a.seq, a.vocab, seed=0)
    losses, times = [], []
    engine.train()
    for i in range(a.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        j = 0 if a.same_batch else i
        tokens = data[j * a.micro:(j + 1) * a.micro].to("cuda", non_blocking=False)
        loss = lm_loss(engine, tokens)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float().item()))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        print(f"step {i}  loss {losses[-1]:.4f}  {times[-1]:.2f} s", flush=True)

    median = statistics.median(times[1:] or times)
    device_peak, device_reserved_peak = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    phases = []
    for _ in range(a.phase_steps):
        tokens = data[:a.micro].to("cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = lm_loss(engine, tokens)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        engine.backward(loss)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        print(f"phases: forward {phases[-1][0]:.3f} s, backward {phases[-1][1]:.3f} s, step {phases[-1][2]:.3f} s",
              flush=True)
    ru_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = dict(
        impl="deepspeed", deepspeed=deepspeed.__version__, torch=torch.__version__,
        cuda=torch.version.cuda, device=torch.cuda.get_device_name(0), accelerator=get_accelerator()._name,
        params=n, losses=losses, step_times_s=times, median_step_s=median,
        tokens_per_s=a.micro * a.seq / median,
        device_peak_gb=device_peak / 2**30, device_reserved_peak_gb=device_reserved_peak / 2**30,
        phases_s=phases,
        # ru_maxrss: the whole process's peak (init included; VmHWM's reset can lower it on Linux, so
        # the larger of it and the peak read before the reset)
        host_peak_gb=max(ru_peak, init_host_peak) / 2**30,
        init_host_peak_gb=init_host_peak / 2**30,
        train_host_peak_gb=(hwm() / 2**30) if hwm_reset else None,  # fz's host_peak_gb's meaning
        init_s=init_s, zero_init_s=zero_init_s, optimizer_init_s=optimizer_s, initialize_s=initialize_s,
        optimizer=optimizer_name, optimizer_fallback=fallback, lr=a.lr, weight_decay=a.weight_decay,
        activation_checkpointing=bool(ckpt_blocks), same_batch=a.same_batch,
        device_cap_gb=a.device_gb, micro=a.micro, seq=a.seq, dim=a.dim, layers=a.layers, heads=a.heads,
        vocab=a.vocab, steps=a.steps, stage=a.stage, ds_config=ds_config,
    )
    if hasattr(torch.cuda, "host_memory_stats"):  # pinned memory torch's host allocator holds
        try:
            stats = torch.cuda.host_memory_stats()
            out["pinned_allocator"] = {k: v / 2**30 for k, v in stats.items()
                                       if k in ("allocated_bytes.current", "reserved_bytes.current",
                                                "allocated_bytes.peak", "reserved_bytes.peak")}
        except Exception:
            pass
    rss_now = rss()
    out["host_rss_end_gb"] = rss_now / 2**30 if rss_now is not None else None
    return out


def main(argv=None) -> int:
    a = parse_args(argv)  # --help and bad arguments exit here, before anything is imported
    try:
        out = run(a)
        print("RESULT " + json.dumps(out), flush=True)
    except Exception as e:
        traceback.print_exc()
        sys.stderr.flush()
        print("RESULT " + json.dumps({"impl": "deepspeed", "error": f"{type(e).__name__}: {str(e)[:500]}"}),
              flush=True)
    finally:
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
