"""Train a Hugging Face `transformers` causal LM with fz from a DeepSpeed config whose values
are "auto" (as the HF Trainer writes them), export it with `fz consolidate` and load the
export back with `from_pretrained`. Nothing is downloaded: the model comes from a small
config and the text is the source of a few standard-library modules, as bytes.

    .venv/bin/pip install -e '.[hf]'
    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 examples/hf_causal_lm.py
    .venv/bin/python examples/hf_causal_lm.py --ci          # one process, a short run
"""
from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch.utils.data import TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import fz

HERE = Path(__file__).resolve().parent


def corpus(seq: int) -> TensorDataset:
    """Windows of `seq` bytes of a few standard-library modules' source (HF shifts the labels itself)."""
    text = "".join(inspect.getsource(m) for m in (argparse, json, textwrap, inspect)).encode()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    return TensorDataset(data.unfold(0, seq, seq))


def loss_fn(model, batch) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="hf_export")
    ap.add_argument("--ckpt-dir", default="checkpoints/hf_causal_lm")
    ap.add_argument("--ci", action="store_true", help="a short run")
    ap.add_argument("--explain", action="store_true", help="print where each Spec value came from (JSON, auto)")
    args = ap.parse_args()
    steps = 40 if args.ci else args.steps

    rank, world = fz.distributed.init()
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)  # token ids within this byte vocabulary
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)  # built normally: fz takes rank 0's values (HF modules lack reset_parameters)
    model.loss_type = "ForCausalLM"  # GPT-2 leaves it None, and transformers warns at the first loss

    # The HF Trainer's way: the JSON says "auto", the code gives the values (explain() shows which went where).
    spec = fz.Spec.from_deepspeed(HERE / "hf_ds_config.json", lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01,
                                  micro_batch=8, grad_accum=1, clip_grad_norm=1.0, precision="fp32",
                                  total_steps=steps, warmup_steps=steps // 10)
    spec = spec.replace(loss_fn=loss_fn)
    if rank == 0 and args.explain:
        print(spec.explain())
    state = fz.init(model, spec)  # GPT2's blocks (transformer.h.*) are the ZeRO-3 units

    loader = fz.data.loader(corpus(config.n_positions), state)
    monitor = fz.Monitor.from_spec(spec, total_steps=steps)  # the JSON says how often (steps_per_print)
    losses = []
    for batch in loader:
        if int(state.step) >= steps:
            break
        state, loss = fz.train_step(state, batch)
        monitor(state, loss, batch)
        losses.append(float(loss))
    monitor.close()
    with fz.Checkpointer(args.ckpt_dir) as ckpt:  # leaving the block waits for the save
        if ckpt.latest_step() != int(state.step):
            ckpt.save(loader.attach(state))

    probe = corpus(config.n_positions).tensors[0][:2]
    fz_logits = fz.apply(state, input_ids=probe).logits  # every rank (stage 3 gathers block by block)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(exist_ok=True)
        subprocess.run([sys.executable, "-m", "fz", "consolidate", args.ckpt_dir, str(out / "model.safetensors")],
                       check=True)  # the `fz consolidate` command; tied lm_head.weight is stored once
        config.save_pretrained(out)
        loaded = GPT2LMHeadModel.from_pretrained(out).eval()
        with torch.no_grad():
            diff = (loaded(input_ids=probe).logits - fz_logits).abs().max().item()
        print(json.dumps({"exported": str(out), "files": sorted(p.name for p in out.iterdir())}))
        print(f"from_pretrained: {'same logits as fz' if diff < 1e-4 else 'DIFFERENT logits'} (max diff {diff:.2e})")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
