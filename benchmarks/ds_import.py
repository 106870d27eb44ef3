"""Importing a DeepSpeed ZeRO-3 checkpoint of a 1.1B-parameter model: `fz consolidate` against
DeepSpeed's own zero_to_fp32.py, time and peak RSS, on the same files.

    OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/ds_import.py --dir /tmp/ds_import \
        --deepspeed-python /work/venv-ds/bin/python

The checkpoint is synthetic (tests/support/ds_synth.py: DeepSpeed's exact stage-3 file layout,
checked against a real fixture by tests/unit/test_ds_peak.py): training a 1.1B model with
DeepSpeed at world 2 needs ~18 GB of model states and days of 2 CPU cores. Shapes are
TinyLlama-1.1B's (vocab 32000, hidden 2048, MLP 5632, 22 layers, 4 KV heads), fp32 masters
plus AdamW moments, world 2. Each tool runs in its own process under /usr/bin/time -v (wall
time, maximum resident set size); the outputs are then compared tensor by tensor, streamed.
Then `fz.import_deepspeed` into a ZeRO-3 state of the same model (transformers' Llama on the meta
device) at world 2: its seconds and peak RSS above the state, per rank.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def llama_params(vocab: int = 32000, hidden: int = 2048, mlp: int = 5632, layers: int = 22,
                 kv: int = 256) -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)), (p + "self_attn.q_proj.weight", (hidden, hidden)),
                (p + "self_attn.k_proj.weight", (kv, hidden)), (p + "self_attn.v_proj.weight", (kv, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, hidden)), (p + "post_attention_layernorm.weight", (hidden,)),
                (p + "mlp.gate_proj.weight", (mlp, hidden)), (p + "mlp.up_proj.weight", (mlp, hidden)),
                (p + "mlp.down_proj.weight", (hidden, mlp))]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def timed(cmd: list[str], env: dict[str, str] | None = None, timeout: int = 3600) -> dict:
    """Wall seconds and peak RSS (MB) of `cmd` in a fresh process, from /usr/bin/time -v."""
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t
    if r.returncode:
        raise RuntimeError(f"{cmd[:3]} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))  # type: ignore[union-attr]
    return {"seconds": round(wall, 1), "peak_rss_mb": round(rss / 1024)}


def fz_consolidate(ckpt: Path, out: Path) -> dict:
    return timed([sys.executable, "-m", "fz", "consolidate", str(ckpt), str(out)],
                 env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def zero_to_fp32(ckpt: Path, out: Path, python: str) -> dict:
    """DeepSpeed's script as users run it: the copy save_checkpoint leaves in the save_dir,
    `zero_to_fp32.py CKPT OUT_DIR --safe_serialization` (run from deepspeed/utils/ itself, its
    folder's torch.py would shadow torch)."""
    code = "import deepspeed.utils.zero_to_fp32 as z; print(z.__file__)"
    src = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"}).stdout.strip().splitlines()[-1]
    shutil.copy(src, ckpt / "zero_to_fp32.py")
    return timed([python, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(out), "--safe_serialization"],
                 env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})


_IMPORT = r"""
import json, time, torch
import fz
from fz.distributed import init as dist_init
from tests.support.peak_worker import rss
from transformers import LlamaConfig, LlamaForCausalLM
torch.set_num_threads(1)
rank, world = dist_init()
cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers={layers},
                  num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False)
with torch.device("meta"):
    model = LlamaForCausalLM(cfg)
state = fz.init(model, fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=1e-4)))
before = rss("VmRSS")
t = time.perf_counter()
state, client = fz.import_deepspeed(state, "{ckpt}")
took = time.perf_counter() - t
print("RESULT", json.dumps({{"rank": rank, "import_s": round(took, 1), "state_rss_mb": round(before / 2**20),
                             "peak_rss_mb": round(rss("VmHWM") / 2**20),
                             "peak_above_state_mb": round((rss("VmHWM") - before) / 2**20), "step": int(state.step)}}),
      flush=True)
"""


def import_into_fz_state(ckpt: Path, layers: int) -> dict:
    """fz.import_deepspeed into a ZeRO-3 fp32 state of the same Llama (transformers' LlamaForCausalLM,
    built on the meta device) at world 2 (torchrun): per rank, the import's seconds and its peak RSS
    above the state's own (the state holds params and both moments: ~6.6 GB per rank)."""
    code = _IMPORT.format(layers=layers, ckpt=ckpt)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "--no-python", sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=3600, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    if r.returncode:
        raise RuntimeError(f"import into fz state failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    ranks = [json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    return {"wall_s_with_init": round(time.perf_counter() - t, 1), "ranks": sorted(ranks, key=lambda x: x["rank"])}


def same(fz_out: Path, ds_out: Path) -> int:
    """Tensors compared (all equal), streamed chunk by chunk; raises on a difference. `ds_out`:
    zero_to_fp32's folder (one file, or shards and their index)."""
    import torch

    from fz.ckpt.hf.weights import WeightFiles, read
    a, b = WeightFiles(fz_out).entries, WeightFiles(ds_out).entries
    if set(a) != set(b):
        raise AssertionError(f"names differ: {sorted(set(a) ^ set(b))[:5]}")
    for name, e in a.items():
        for (_, x), (_, y) in zip(read(e, 0, e.numel), read(b[name], 0, e.numel)):
            if not torch.equal(x, y):
                raise AssertionError(f"{name} differs")
    return len(a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ds_import"))
    ap.add_argument("--deepspeed-python", default="/work/venv-ds/bin/python")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and outputs")
    args = ap.parse_args()
    from tests.support import ds_synth

    params = llama_params(layers=args.layers)
    numel = sum(math.prod(s) for _, s in params)
    shutil.rmtree(args.dir, ignore_errors=True)
    ckpt = args.dir / "ckpt"
    t = time.perf_counter()
    ds_synth.write(ckpt / "global_step1", params, 2, step=1)
    written = time.perf_counter() - t
    size = sum(f.stat().st_size for f in (ckpt / "global_step1").iterdir())
    res: dict = {"params": numel, "checkpoint_gb": round(size / 1e9, 2), "write_s": round(written, 1)}
    try:
        res["fz consolidate"] = fz_consolidate(ckpt, args.dir / "fz.safetensors")
        res["zero_to_fp32.py"] = zero_to_fp32(ckpt, args.dir / "ds_out", args.deepspeed_python)
        res["ds_output_files"] = sorted(p.name for p in (args.dir / "ds_out").iterdir())
        res["tensors_equal"] = same(args.dir / "fz.safetensors", args.dir / "ds_out")
        res["import into fz state"] = import_into_fz_state(ckpt, args.layers)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
