"""Issue 24's headline: a pretrained model bigger than the machine, in and out.

A Llama of about 2.5B parameters is written as a Hugging Face folder (bf16 safetensors shards
and their index, values made here tensor by tensor, never the whole model in memory); then
at world 2, ZeRO-3 with parameters and optimizer state on disk: `fz.init(meta_model, spec,
weights=folder)`, 3 fine-tuning steps on one batch (the loss must fall), `fz.generate` of 16
tokens (streamed from disk), and `fz.hf.save_pretrained` back to a folder. Each phase's time,
peak RSS per rank and the disk bytes are printed.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pretrained.py --dir /work/pretrained-bench
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import git_state, launch, load_average, markdown, report, rss_mb


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="working directory: the HF folder, the NVMe tier, the export")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--intermediate", type=int, default=6912)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--buffer-mb", type=float, default=512.0, help="the NVMe tier's I/O buffers (3 of them); one "
                   "parameter's optimizer rows must fit one (the embedding's: 0.49 GB per rank here)")
    p.add_argument("--timeout", type=float, default=3000.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def config(args: argparse.Namespace):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                       num_key_value_heads=args.hidden // 128, max_position_embeddings=args.seq * 2,
                       tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)


def write_folder(args: argparse.Namespace, folder: str) -> dict:
    """The HF folder, tensor by tensor (deterministic values; norms at 1), in 2 GB shards."""
    import torch
    from transformers import LlamaForCausalLM

    from fz.ckpt.hf.folder import INDEX, filenames, shards
    from fz.ckpt.hf.safetensors_io import StreamWriter
    cfg = config(args)
    marker = os.path.join(folder, "config.json")
    if os.path.exists(os.path.join(folder, INDEX)) and json.load(open(marker)).get("num_hidden_layers") == args.layers:
        return {"reused": True}
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    shapes = [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    groups = shards([(n, 2 * torch.Size(s).numel()) for n, s in shapes], 2 * 10**9)
    names = filenames(len(groups))
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    weight_map = {}
    for fname, group in zip(names, groups):
        w = StreamWriter(os.path.join(folder, fname), [(n, torch.bfloat16, dict(shapes)[n]) for n in group])
        for n in group:
            shape = dict(shapes)[n]
            value = torch.ones(shape) if n.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02
            w.write(n, value.to(torch.bfloat16))
            weight_map[n] = fname
        w.close()
    total = sum(2 * torch.Size(s).numel() for _, s in shapes)
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    cfg.save_pretrained(folder)
    return {"reused": False, "write_s": time.perf_counter() - t0, "bytes": total,
            "params": sum(torch.Size(s).numel() for _, s in shapes)}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import fz
    import fz.hf
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder, tier, out = (os.path.join(args.dir, d) for d in ("hf", f"tier{rank}", "export"))
    os.makedirs(tier, exist_ok=True)
    phases: dict[str, float] = {}
    rss: dict[str, float] = {}

    def phase(name: str, t0: float) -> None:
        phases[name] = time.perf_counter() - t0
        rss[name] = rss_mb("VmHWM")

    with torch.device("meta"):
        model = LlamaForCausalLM(config(args))

    def loss_fn(m, batch):
        return m(input_ids=batch, labels=batch).loss

    spec = fz.Spec(stage=3, precision="bf16", optimizer=fz.optim.adamw(lr=args.lr), clip_grad_norm=1.0,
                   loss_fn=loss_fn, offload=fz.offload.nvme(tier, params=True, buffer_mb=args.buffer_mb, buffers=3,
                                                          prefetch=2))
    t0 = time.perf_counter()
    state = fz.init(model, spec, weights=folder)
    phase("load", t0)
    batch = torch.randint(3, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(rank))
    losses, step_s = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, loss = fz.train_step(state, batch)
        losses.append(float(loss))
        step_s.append(time.perf_counter() - t0)
    phases["train"] = sum(step_s)
    rss["train"] = rss_mb("VmHWM")
    t0 = time.perf_counter()
    prompt = batch[:, :8]
    ids = fz.generate(state, prompt, max_new_tokens=args.new_tokens, do_sample=False, residency="stream")
    phase("generate", t0)
    t0 = time.perf_counter()
    fz.hf.save_pretrained(state, out)
    phase("export", t0)
    disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(tier) for f in fs)
    result = {"phases": phases, "rss_mb": rss, "losses": losses, "step_s": step_s, "tier_bytes": disk,
              "new_tokens": int(ids.shape[1] - prompt.shape[1]), "tiers": fz.memory_report(state).tiers}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        report({"ranks": gathered})
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    print(f"$ {' '.join(sys.argv)}\n{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load average "
          f"{load_average()}, {git_state()}", flush=True)
    os.makedirs(args.dir, exist_ok=True)
    made = write_folder(args, os.path.join(args.dir, "hf"))
    print(f"HF folder: {made}", flush=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    res = launch(cmd, 2, args.timeout)
    if "error" in res:
        print("FAILED:", res["error"], *res.get("tail", []), sep="\n")
        return
    rows = []
    for r, x in enumerate(res["ranks"]):
        rows.append([f"rank {r}", *(f"{x['phases'][k]:.1f}" for k in ("load", "train", "generate", "export")),
                     *(f"{x['rss_mb'][k]:.0f}" for k in ("load", "train", "generate", "export")),
                     f"{x['tier_bytes'] / 1e9:.2f}", " ".join(f"{v:.3f}" for v in x["losses"])])
    print(markdown(["", "load s", "train s (3 steps)", "generate s", "export s", "peak RSS MB after load", "train",
                    "generate", "export", "NVMe tier GB", "losses"], rows))
    exported = sum(os.path.getsize(os.path.join(args.dir, "export", f)) for f in os.listdir(os.path.join(args.dir,
                                                                                                           "export")))
    du = subprocess.run(["du", "-sb", args.dir], capture_output=True, text=True).stdout.split()[0]
    print(f"export folder {exported / 1e9:.2f} GB; working directory {int(du) / 1e9:.2f} GB; "
          f"new tokens {res['ranks'][0]['new_tokens']}; load average at end {load_average()}")


if __name__ == "__main__":
    main()
