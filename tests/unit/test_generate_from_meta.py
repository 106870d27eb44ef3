"""fz.generate at stage 3 with parameters on disk, from a model built on the meta device and
weights read from a Hugging Face folder: the root's leaves are fetched per use, so the root
holds no parameter of its own, and HF's generate, which asks the model for its device and
dtype, must still run (found by benchmarks/pretrained.py)."""
from __future__ import annotations

import pytest
import torch

import fz

transformers = pytest.importorskip("transformers")


def test_generate_from_a_meta_model_loaded_from_a_folder_equals_hf(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(cfg)
    offload = fz.offload.nvme(str(tmp_path), params=True)  # the root's leaves fetched per use: none stay on it
    state = fz.init(meta, fz.Spec(stage=3, offload=offload), weights=tmp_path / "hf")
    prompt = torch.randint(3, 101, (2, 5), generator=torch.Generator().manual_seed(1))
    ours = fz.generate(state, prompt, max_new_tokens=6, do_sample=False, residency="stream")
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(ours, ref.generate(prompt, max_new_tokens=6, do_sample=False))
    assert "_fz_device_probe" not in dict(state.skeleton.root.named_parameters())  # nothing left behind
