"""What fz writes of a PEFT model is what PEFT writes, in the cases PEFT adds to the adapter: a
vocabulary resized from the base (the "add tokens, resize, LoRA" recipe) or a targeted embedding
saves the embedding layers too; a Trainer's checkpoint-N holds the adapter; `fz consolidate --hf`
of a PEFT model's checkpoint refuses rather than write a folder that loads untrained."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import fz
import fz.hf
from fz.ckpt.export import consolidate
from fz.errors import CheckpointError

from support import hf_pipeline as hp

peft = pytest.importorskip("peft")
IDS = torch.arange(16).view(2, 8) % 60


def _resized_lora(base_dir: str, target: list[str]) -> torch.nn.Module:
    base = hp.llama()
    base.save_pretrained(base_dir)
    model = type(base).from_pretrained(base_dir)
    model.resize_token_embeddings(base.config.vocab_size + 4)
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=target,
                                                      init_lora_weights=False))


@pytest.mark.parametrize("target", [["q_proj", "v_proj"], ["q_proj", "embed_tokens"]])
def test_the_adapter_holds_the_embeddings_where_peft_saves_them(tmp_path, target):
    model = _resized_lora(str(tmp_path / "base"), target)
    model.save_pretrained(tmp_path / "peft")  # PEFT's own writer, for its key set
    state = fz.init(model, fz.Spec(optimizer=fz.optim.adamw(1e-2),
                                   loss_fn=lambda m, ids: m(input_ids=ids, labels=ids).loss))
    state, _ = fz.train_step(state, IDS)
    fz.hf.save_pretrained(state, tmp_path / "fz", model=model)
    want = set(load_file(tmp_path / "peft" / "adapter_model.safetensors"))
    got = set(load_file(tmp_path / "fz" / "adapter_model.safetensors"))
    assert got == want and any("embed_tokens" in k for k in got)
    fresh = _resized_lora(str(tmp_path / "base2"), target).get_base_model()
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "fz")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, fz.apply(state, input_ids=IDS).logits)


def _peft_checkpoint(tmp_path, on_fz: bool):
    import transformers
    torch.manual_seed(1)
    model = peft.get_peft_model(hp.llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    hf = fz.hf if on_fz else transformers
    args = hf.TrainingArguments(str(tmp_path / str(on_fz)), per_device_train_batch_size=4, max_steps=2, save_steps=2,
                                learning_rate=3e-3, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = hf.Trainer(model=model, args=args, train_dataset=hp.causal_lm_data(), data_collator=hp.collator("lm"))
    trainer.train()
    return trainer, tmp_path / str(on_fz) / "checkpoint-2"


def test_a_trainer_checkpoint_holds_the_adapter_and_consolidate_hf_refuses_it(tmp_path):
    """checkpoint-N holds the files transformers' holds (the adapter's, not the base model's
    config), fz's State in place of its optimizer, scheduler and generator files."""
    trainer, folder = _peft_checkpoint(tmp_path, True)
    _, theirs = _peft_checkpoint(tmp_path, False)
    torch_files = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt"}
    assert set(os.listdir(folder)) - {"fz"} == set(os.listdir(theirs)) - torch_files
    assert json.loads((folder / "adapter_config.json").read_text())["peft_type"] == "LORA"
    saved = load_file(folder / "adapter_model.safetensors")
    trained = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}
    assert len(saved) == len(trained) > 0
    with pytest.raises(CheckpointError, match="is a PEFT model's"):
        consolidate(folder / "fz", tmp_path / "out", hf=True)
    assert not os.path.exists(tmp_path / "out")


def test_every_adapter_is_written_in_the_runs_precision(tmp_path):
    """A PeftModel of two adapters (TRL's reference-adapter recipe): PEFT writes each in its own
    folder, the untrained one too; fz wrote only what trains, so `first/` held the trained second
    adapter's tensors under its names. In a bf16 run the adapters are written in bf16, as DeepSpeed's
    bf16 module writes them (they were fp32)."""
    torch.manual_seed(1)
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(hp.llama(), peft.LoraConfig(**config), adapter_name="first")
    model.add_adapter("second", peft.LoraConfig(**config))
    model.set_adapter("second")
    untrained = {k: v.clone() for k, v in model.state_dict().items() if ".first." in k}
    model.save_pretrained(tmp_path / "peft")  # PEFT's own writer: its files and keys
    state = fz.init(model, fz.Spec(optimizer=fz.optim.adamw(1e-2), precision="bf16",
                                   loss_fn=lambda m, ids: m(input_ids=ids, labels=ids).loss))
    state, _ = fz.train_step(state, IDS)
    out = fz.hf.save_pretrained(state, tmp_path / "fz", model=model)
    assert out.dtype == "bfloat16"
    for folder in ("first", "second"):
        want = load_file(tmp_path / "peft" / folder / "adapter_model.safetensors")
        got = load_file(tmp_path / "fz" / folder / "adapter_model.safetensors")
        assert set(got) == set(want) and all(t.dtype == torch.bfloat16 for t in got.values()), folder
    first = load_file(tmp_path / "fz" / "first" / "adapter_model.safetensors")
    for key, t in first.items():  # the reference adapter as it was, in bf16
        name = next(k for k in untrained if k.replace(".first", "") == key)
        assert torch.equal(t, untrained[name].to(torch.bfloat16)), key


@pytest.mark.parametrize("name", ["default", "model", "0"])
def test_an_adapters_parameters_are_its_own_whatever_its_name(name):
    """An adapter named like a module path's part ("model", "0") took every base weight for its own:
    the writing rank gathered the whole model to write an adapter."""
    from fz.hf.peft_export import _adapters_parameters
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(hp.llama(), lora, adapter_name=name)
    assert _adapters_parameters(model) == {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("config", ["deep", "sparse 2 GiB"])
def test_the_base_config_an_adapter_names_is_read_bounded(tmp_path, config):
    """Whether the embeddings were resized is read from the config.json an adapter's
    base_model_name_or_path names: a deep one was a raw RecursionError, a 2 GiB one read whole."""
    import types

    from fz.hf.peft_export import _embeddings_peft_saves
    if config == "deep":
        (tmp_path / "config.json").write_text("[" * 200000 + "]" * 200000)
    else:
        with open(tmp_path / "config.json", "wb") as f:
            f.truncate(2 << 30)
    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(4, 2)
    m.get_input_embeddings = lambda: m.emb
    m.peft_config = {"default": types.SimpleNamespace(base_model_name_or_path=str(tmp_path))}
    m.config = types.SimpleNamespace(vocab_size=4)
    assert _embeddings_peft_saves(m) == {}  # unreadable: not known to be resized, as an unparsable one was


def _adapter(kind: str):
    """PEFT configs whose saved file holds more than the trainable parameters' first names: VeRA's
    projections are buffers, VBLoRA's vector bank is one parameter under several names; prompt learning's
    embeddings are computed by the model's prompt encoder when PEFT saves."""
    task = {"task_type": "CAUSAL_LM"}
    return {"vera": lambda: peft.VeraConfig(r=4, target_modules=["q_proj", "v_proj"]),
            "vblora": lambda: peft.VBLoRAConfig(r=2, target_modules=["q_proj", "v_proj"], num_vectors=8,
                                                vector_length=16),
            "prompt": lambda: peft.PromptTuningConfig(num_virtual_tokens=3, **task),
            "p-tuning": lambda: peft.PromptEncoderConfig(num_virtual_tokens=3, encoder_hidden_size=16, **task),
            "prefix": lambda: peft.PrefixTuningConfig(num_virtual_tokens=3, **task),
            # buffers PEFT's own save leaves out (not persistent), which it would write if handed them
            "oft": lambda: peft.OFTConfig(r=0, oft_block_size=8, target_modules=["q_proj", "v_proj"]),
            "boft": lambda: peft.BOFTConfig(boft_block_size=8, target_modules=["q_proj", "v_proj"]),
            "tokens": lambda: peft.TrainableTokensConfig(target_modules=["embed_tokens"], token_indices=[1, 2])}[kind]()


@pytest.mark.parametrize("kind, stage", [("vera", 2), ("vera", 3), ("vblora", 3), ("prompt", 3), ("p-tuning", 3),
                                         ("prefix", 3), ("oft", 3), ("boft", 3), ("tokens", 3)])
def test_every_adapter_type_saves_as_peft_saves_it(tmp_path, kind, stage):
    """VeRA and VBLoRA could not be saved at all (PEFT missed the projections, the bank's name), prompt
    learning not mid-training at ZeRO-3 (PEFT runs the prompt encoder, empty there): now each checkpoint's
    adapter holds PEFT's own keys (not the buffers PEFT leaves out), and the final one loads with the trained
    logits."""
    def model():
        return peft.get_peft_model(hp.llama(), _adapter(kind))

    model().save_pretrained(tmp_path / "peft")  # PEFT's own writer, for its key set
    args = fz.hf.TrainingArguments(str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=2, save_steps=1,
                                   learning_rate=1e-2, report_to=[], use_cpu=True, disable_tqdm=True,
                                   deepspeed=hp.deepspeed(stage))
    trainer = fz.hf.Trainer(model=model(), args=args, train_dataset=hp.causal_lm_data(),
                            data_collator=hp.collator("lm"))
    trainer.train()
    want = set(load_file(tmp_path / "peft" / "adapter_model.safetensors"))
    for step in (1, 2):
        assert set(load_file(tmp_path / "run" / f"checkpoint-{step}" / "adapter_model.safetensors")) == want
    loaded = peft.PeftModel.from_pretrained(hp.llama(), tmp_path / "run" / "checkpoint-2").eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=IDS).logits, trainer.model.eval()(input_ids=IDS).logits, atol=1e-6)
