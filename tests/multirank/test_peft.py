"""PEFT adapters on a ZeRO-3 State (issue 41): LoRA and IA3 on a tiny Llama at world 2.

- Memory: gradients and optimizer state exist for the adapters only; with precision bf16 the
  frozen base is held in bf16 (2 bytes a parameter, its shard on each rank), also when the
  parameters live in host memory; fz.memory_report's bytes against the counts made here.
- Writing: `fz.hf.save_pretrained` of the PeftModel writes what `PeftModel.save_pretrained`
  writes (adapter_config.json, adapter_model.safetensors), and `PeftModel.from_pretrained(base,
  folder)` gives fz.apply's logits exactly; `merged=True` writes the merged model that
  `from_pretrained` loads, its logits fz.apply's to fp32 rounding (merging adds W + BA once).
- Through a Trainer: TRL's SFTTrainer with a LoRA `peft_config` on fz trains the adapter only,
  and `save_model` writes the adapter files TRL's own run writes.
"""
from __future__ import annotations

import os

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("trl")

from fz.testing.spawn import run_ranks  # noqa: E402

from support.hf_pipeline import llama  # noqa: E402

IDS = torch.arange(16).view(2, 8) % 60


def adapted(kind: str) -> torch.nn.Module:
    torch.manual_seed(1)
    if kind == "lora":
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    else:
        cfg = peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
                             init_ia3_weights=False)
    return peft.get_peft_model(llama(), cfg)


def _lm(model, batch):
    return model(**batch).loss


def _job(rank: int, world: int, out: str) -> dict:
    import fz.hf
    res: dict = {}
    for kind in ("lora", "ia3"):
        for precision, offload in (("fp32", None), ("bf16", None), ("bf16", fz.offload.cpu(params=True))):
            model = adapted(kind)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            spec = fz.Spec(stage=3, precision=precision, offload=offload, optimizer=fz.optim.adamw(lr=1e-2),
                           loss_fn=_lm)
            state = fz.init(model, spec)
            g = torch.Generator().manual_seed(rank)
            for _ in range(3):
                x = torch.randint(4, 60, (2, 8), generator=g)
                state, _ = fz.train_step(state, {"input_ids": x, "labels": x})
            r = fz.memory_report(state)
            res[kind, precision, offload is not None] = {
                "trainable": trainable, "all": r.num_params, "params": r.params, "grads": r.grads, "opt": r.opt,
                "padding": r.padding, "tiers": r.tiers,
                "formula": (r.formula_params, r.formula_grads, r.formula_opt)}
            if precision == "fp32":
                folder = os.path.join(out, kind)
                res[kind, "files"] = fz.hf.save_pretrained(state, folder, model=model).files
                res[kind, "merged"] = fz.hf.save_pretrained(state, folder + "-merged", model=model, merged=True).files
                res[kind, "logits"] = fz.apply(state, input_ids=IDS).logits
    return res


def _trainer_job(rank: int, world: int, out: str, on_fz: bool) -> list[str]:
    import trl

    import fz.hf

    from support.hf_pipeline import deepspeed, tokenizer
    from support.trl_jobs import GLOBAL_BATCH, dataset
    trainer_cls, config_cls = (fz.hf.on_fz(trl.SFTTrainer), fz.hf.on_fz(trl.SFTConfig)) if on_fz else \
        (trl.SFTTrainer, trl.SFTConfig)
    args = config_cls(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // world, max_steps=2,
                      report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, max_length=32, bf16=False,
                      **({"deepspeed": deepspeed(3)} if on_fz else {}))
    trainer = trainer_cls(model=llama(), args=args, train_dataset=dataset("sft"), processing_class=tokenizer(),
                          peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    return sorted(os.listdir(os.path.join(out, "final")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("peft")
    ranks = run_ranks(2, _job, str(out), timeout=600)
    ours = run_ranks(2, _trainer_job, str(out / "fz"), True, timeout=600)[0]
    theirs = run_ranks(1, _trainer_job, str(out / "trl"), False, timeout=600)[0]
    return ranks, out, ours, theirs


@pytest.mark.parametrize("kind", ["lora", "ia3"])
def test_gradients_and_optimizer_state_only_for_the_adapters_and_a_bf16_base(runs, kind):
    for precision, offloaded in (("fp32", False), ("bf16", False), ("bf16", True)):
        both = [res[kind, precision, offloaded] for res in runs[0]]
        for r in both:
            n, t = r["all"], r["trainable"]
            assert 0 < t < n // 10
            width = 4 if precision == "fp32" else 2  # bf16: the frozen base (and the gradients) in 2 bytes
            master = 0 if precision == "fp32" else 4
            # this rank's half of: every parameter; the adapters' gradients; two fp32 moments (+ bf16's masters)
            want = (n * width / 2, t * width / 2, t * (8 + master) / 2)
            assert r["formula"] == want, (precision, r)
            tier = "host" if offloaded else "device"
            assert r["tiers"][tier]["params"] == r["params"]
        padding = sum(r["padding"] for r in both)  # rows that do not split evenly (IA3's one-row vectors)
        for key, formula in zip(("params", "grads", "opt"), want):
            assert 0 <= sum(r[key] for r in both) - 2 * formula <= padding, (precision, key, both)


@pytest.mark.parametrize("kind", ["lora", "ia3"])
def test_the_adapter_folder_is_peft_s_and_from_pretrained_gives_fz_apply_s_logits(runs, kind):
    from transformers import LlamaForCausalLM
    ranks, out, _, _ = runs
    assert set(ranks[0][kind, "files"]) >= {"adapter_config.json", "adapter_model.safetensors"}
    with torch.no_grad():
        loaded = peft.PeftModel.from_pretrained(llama(), out / kind).eval()
        assert torch.equal(loaded(input_ids=IDS).logits, ranks[0][kind, "logits"])
        merged = LlamaForCausalLM.from_pretrained(out / f"{kind}-merged").eval()
        assert torch.allclose(merged(input_ids=IDS).logits, ranks[0][kind, "logits"], rtol=0, atol=1e-5)
    assert "model.safetensors" in ranks[0][kind, "merged"]


def test_a_trl_trainer_with_a_lora_config_saves_the_adapter_as_trl_does(runs):
    _, _, ours, theirs = runs
    assert ours == theirs
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(ours)
