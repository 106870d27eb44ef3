"""The resident memory a load adds, measured in a fresh process (test_hf_load.py).

`python -m support.hf_load_peak DIR`: writes a model of 40 tensors of 8 MiB (320 MiB) as a
sharded HF-style folder (safetensors shards of 64 MiB and their index, one tensor at a time),
then, with parameters and optimizer state on NVMe at stage 3, measures VmHWM growth over
`fz.init(meta, spec, weights=folder)` and over `fz.load_weights` into the state that made,
then over writing it back: `fz.hf.save_pretrained` from the live state, and `fz consolidate
--hf` of a checkpoint of it (VmHWM reset through /proc/self/clear_refs just before each).
Prints one JSON line.
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
from torch import nn

from support.peak_worker import rss as status  # /proc/self/status, in bytes

N, ROWS, COLS = 40, 1024, 2048  # fp32: 8 MiB each


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(COLS, ROWS, bias=False) for _ in range(N))

    def forward(self, x):
        return sum(layer(x).sum() for layer in self.layers)


def reset_peak() -> int:
    """VmHWM := VmRSS now (Linux >= 4.0); returns that RSS."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def write_folder(folder: Path) -> None:
    from safetensors.torch import save_file
    folder.mkdir(parents=True)
    per_shard, weight_map = 8, {}
    shards = N // per_shard
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for i in range(s * per_shard, (s + 1) * per_shard):
            g = torch.Generator().manual_seed(i)
            part[f"layers.{i}.weight"] = torch.randn(ROWS, COLS, generator=g)
            weight_map[f"layers.{i}.weight"] = name
        save_file(part, folder / name, metadata={"format": "pt"})
        del part
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _save_pretrained_peak(root: Path) -> int:
    """What fz.hf.save_pretrained adds to VmHWM for a 8-layer Llama of 1024 x 2048 (about 330 MiB of
    fp32, 8 MiB the largest tensor) at stage 3 with parameters and optimizer state on NVMe."""
    import transformers

    import fz
    from fz.hf import save_pretrained
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(cfg)
    (root / "nvme2").mkdir()
    spec = fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=1e-3), offload=fz.offload.nvme(str(root / "nvme2"),
                                                                                         params=True))
    state = fz.init(llama, spec)
    base = reset_peak()
    save_pretrained(state, root / "exported", max_shard_size=64 * 2**20)
    return status("VmHWM") - base


def main(tmp: str) -> None:
    import fz
    root = Path(tmp)
    folder = root / "big"
    write_folder(folder)
    (root / "nvme").mkdir()
    with torch.device("meta"):
        model = Stack()
    spec = fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=1e-3), offload=fz.offload.nvme(str(root / "nvme"), params=True))
    base = reset_peak()
    state = fz.init(model, spec, weights=folder)
    init = status("VmHWM") - base
    base = reset_peak()
    state = fz.load_weights(state, folder)
    load = status("VmHWM") - base
    from fz.ckpt import consolidate
    exported = _save_pretrained_peak(root)
    fz.save(state, root / "ck", verbose=False)
    base = reset_peak()
    consolidate(root / "ck", root / "consolidated", hf=True, max_shard_size=64 * 2**20)
    consolidated = status("VmHWM") - base
    probe = [0, N // 2, N - 1]
    full = fz.full_params(state)
    g = [torch.Generator().manual_seed(i) for i in probe]
    equal = all(torch.equal(full[f"layers.{i}.weight"], torch.randn(ROWS, COLS, generator=gi))
                for i, gi in zip(probe, g))
    print(json.dumps({"init": init, "load": load, "save_pretrained": exported, "consolidate_hf": consolidated,
                      "total": N * ROWS * COLS * 4, "largest": ROWS * COLS * 4,
                      "shards": len(list(folder.glob("*.safetensors"))), "equal": equal}))


if __name__ == "__main__":
    main(sys.argv[1])
