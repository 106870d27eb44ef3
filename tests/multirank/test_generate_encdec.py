"""fz.generate on encoder-decoder models (issue 41): BART, T5 and Whisper (`input_features=`),
tiny ones built from configs, greedy, against the model's own generate: the same tokens at
stages 0 and 3, worlds 1 and 2, left-padded prompts of different lengths included. HF's
generate runs the encoder itself (not through the root's forward): it runs on the state's
weights too. Also: a generate that fails before any collective leaves a stage 0-2 state
usable, and a forward a library set on the model's instance (TRL's fused head) is kept.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import fz  # noqa: E402
from fz.testing.spawn import run_ranks  # noqa: E402


def models() -> dict[str, torch.nn.Module]:
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        T5Config,
        T5ForConditionalGeneration,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )
    torch.manual_seed(0)
    bart = BartForConditionalGeneration(BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=None,
        forced_eos_token_id=None, dropout=0.0))
    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                             num_decoder_layers=2, num_heads=2, pad_token_id=0, eos_token_id=1,
                                             decoder_start_token_id=0, dropout_rate=0.0))
    torch.manual_seed(0)
    whisper = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=64, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=32, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=3,
        suppress_tokens=[], begin_suppress_tokens=[]))
    return {"bart": bart, "t5": t5, "whisper": whisper}


def _inputs(name: str, model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    if name == "whisper":
        return {"input_features": torch.randn(2, 8, 32, generator=g)}
    ids = torch.randint(3, 60, (2, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2 + rank] = 0  # left padding, another length on each rank
    ids[0, :2 + rank] = model.config.pad_token_id
    return {"input_ids": ids, "attention_mask": mask}


def _job(rank: int, world: int) -> dict:
    out: dict = {}
    for stage in (0, 3):
        for name, model in models().items():
            model.eval()
            state = fz.init(model, fz.Spec(stage=stage))
            given = _inputs(name, model, rank)
            got = fz.generate(state, **given, max_new_tokens=5, do_sample=False)
            with torch.no_grad():
                want = model.generate(**given, max_new_tokens=5, do_sample=False)
            out[name, stage] = (got, want)
    for stage in (0, 2):  # a failure inside HF's generate, before any collective: the state stays usable
        model = models()["bart"].eval()
        state = fz.init(model, fz.Spec(stage=stage))
        given = _inputs("bart", model, rank)
        try:
            fz.generate(state, **given, max_new_tokens=5, num_beams=2, num_return_sequences=3)
            out["failed", stage] = None
        except ValueError as e:  # HF: more sequences returned than beams
            out["failed", stage] = str(e)[:100]
        out["after", stage] = torch.equal(fz.generate(state, **given, max_new_tokens=5, do_sample=False),
                                          model.generate(**given, max_new_tokens=5, do_sample=False))
    model = models()["bart"].eval()
    marker = model.forward
    object.__setattr__(model, "forward", marker)  # as TRL's add_fused_lm_head sets it
    state = fz.init(model, fz.Spec(stage=3))
    fz.generate(state, **_inputs("bart", model, rank), max_new_tokens=2, do_sample=False)
    out["instance_forward_kept"] = state.skeleton.root.__dict__.get("forward") is not None
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def results(request):
    return run_ranks(request.param, _job, timeout=300)


@pytest.mark.parametrize("name", ["bart", "t5", "whisper"])
def test_greedy_tokens_equal_the_models_own_generate_at_stages_0_and_3(results, name):
    for res in results:
        for stage in (0, 3):
            got, want = res[name, stage]
            assert torch.equal(got, want), (name, stage, got, want)


def test_a_failed_generate_leaves_a_stage_0_2_state_usable(results):
    for res in results:
        for stage in (0, 2):
            assert res["failed", stage], stage  # it did fail
            assert res["after", stage], stage


def test_a_forward_set_on_the_models_instance_is_kept(results):
    assert all(res["instance_forward_kept"] for res in results)
