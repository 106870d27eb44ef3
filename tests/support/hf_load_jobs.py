"""Jobs of tests/multirank/test_hf_load.py: Hugging Face folders written by transformers' own
`save_pretrained`, loaded by `fz.init(meta_model, spec, weights=folder)` on every rank."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

import fz

from support.helpers import max_rel
from support.real_nets import hf_loss, hf_model, reference

SHARD = 20_000  # bytes per shard: every model here is written as several shards
VOCAB = 101  # rows that do not split evenly over 2 ranks (the last rank's padding is exercised)
LR = 1e-2


def build(name: str, seed: int = 0) -> nn.Module:
    """Llama (untied), GPT-2 (tied embeddings), both 2 layers of hidden 32 and vocab 101; Mixtral
    (experts fused in memory by transformers 5, one tensor per expert in its files)."""
    import transformers as tr
    torch.manual_seed(seed)
    ids = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if name == "llama":
        return tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                  max_position_embeddings=16, tie_word_embeddings=False, **ids))
    if name == "gpt2":
        return tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids))
    return hf_model(name, seed)


def on_meta(name: str) -> nn.Module:
    model = build(name)
    with torch.device("meta"):
        return type(model)(model.config)


def batch(step: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(3, 64, (rows, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


def pretrained(folder: str | Path, **kw) -> nn.Module:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, **kw).eval()


def offload(kind: str, tmp: str, tag: str):
    if kind == "cpu":
        return fz.offload.cpu()
    if kind == "nvme":
        path = Path(tmp) / "nvme" / tag
        path.mkdir(parents=True, exist_ok=True)
        return fz.offload.nvme(str(path), params=True)
    return None


def cases(world: int) -> list[tuple[str, int, str]]:
    out = [(m, s, o) for m in ("llama", "gpt2") for s, o in ((0, "none"), (3, "none"), (3, "cpu"), (3, "nvme"))]
    out += [("mixtral", 3, "nvme"), ("mixtral", 0, "none")]
    return out + ([("llama", 1, "cpu"), ("gpt2", 2, "none")] if world == 2 else [])


def _comparable(name: str, t: torch.Tensor) -> torch.Tensor:
    """GPT-2's fused attention bias without its key third: the key bias's gradient is zero in exact
    arithmetic (it shifts every score of a query alike), so Adam's m/sqrt(v) turns rounding noise
    into steps of the learning rate in fz and in the reference alike, in unrelated directions."""
    if name.endswith("attn.c_attn.bias"):
        third = t.numel() // 3
        return torch.cat([t[:third], t[2 * third:]])
    return t


def checks(rank: int, world: int, root: str, tmp: str) -> dict:
    """Per case: logits equal to from_pretrained's, and 3 fine-tuning steps against the plain-torch
    reference from the same folder; then a bf16 folder into a bf16 run (fp32 masters)."""
    warnings.filterwarnings("ignore")
    out: dict = {}
    ids = batch(99, 3)["input_ids"]
    refs: dict = {}
    for name, stage, kind in cases(world):
        folder = Path(root) / name
        if name not in refs:
            data = [batch(i, 2 * world) for i in range(3)]
            losses, sd = reference(lambda folder=folder: pretrained(folder), hf_loss, data, world, lr=LR)
            refs[name] = (pretrained(folder)(input_ids=ids).logits, data, losses, sd)
        want, data, want_losses, want_sd = refs[name]
        spec = fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=LR, weight_decay=0.01), loss_fn=hf_loss,
                       offload=offload(kind, tmp, f"{world}-{rank}-{name}-{stage}"))
        state = fz.init(on_meta(name), spec, weights=folder)
        got = fz.apply(state, input_ids=ids).logits
        losses = []
        for b in data:
            state, loss = fz.train_step(state, {k: v.chunk(world)[rank] for k, v in b.items()})
            losses.append(float(loss))
        full = fz.full_params(state)
        out[name, stage, kind] = {
            "equal": torch.equal(got, want), "diff": float((got - want).abs().max()),
            "loss_rel": max_rel(losses, want_losses),
            "params_off": [k for k in full if not torch.allclose(_comparable(k, full[k]), _comparable(k, want_sd[k]),
                                                                  rtol=1e-5, atol=1e-6)]}
    # a bf16 checkpoint into a bf16 run: fp32 masters made from the file's values exactly
    spec = fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=LR), loss_fn=hf_loss, precision="bf16")
    state = fz.init(on_meta("llama"), spec, weights=Path(root) / "llama-bf16")
    file_bf16 = pretrained(Path(root) / "llama-bf16", dtype=torch.bfloat16).state_dict()
    masters, compute = fz.full_params(state), fz.full_params(state, "compute")
    out["bf16"] = {"masters_fp32": all(t.dtype == torch.float32 for t in masters.values()),
                   "masters_equal": all(torch.equal(masters[k], file_bf16[k].float()) for k in masters),
                   "compute_equal": all(torch.equal(compute[k], file_bf16[k]) for k in compute)}
    state, loss = fz.train_step(state, {k: v.chunk(world)[rank] for k, v in batch(0, 2 * world).items()})
    out["bf16"]["loss"] = float(loss)
    return out
