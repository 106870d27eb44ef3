"""Real models at world 2, stages 0-3, against the single-process reference (one spawn):
plain-torch models that read and iterate their blocks or checkpoint inside them, a BatchNorm
CNN whose statistics stay equal on every rank, and transformers' GPT-2, Llama, BERT, T5 and
ModernBERT from small configs, in fp32 and bf16 (HF's own gradient checkpointing too)."""
from __future__ import annotations

import warnings

import pytest
import torch

import fz

from support.helpers import max_rel
from support.ranks import cached_runs
from support.real_nets import (
    CheckpointsInside,
    MoE,
    Readers,
    TinyResNet,
    hf_loss,
    hf_model,
    images,
    moe_loss,
    mse,
    points,
    reference,
    routed,
    tokens,
    xent,
)

pytest.importorskip("transformers")
STAGES, HF, ROWS = (0, 1, 2, 3), ("gpt2", "llama", "bert", "t5"), 8
PLAIN = {"readers": (Readers, mse, points), "ckpt_inside": (CheckpointsInside, mse, points),
         "resnet": (TinyResNet, xent, images)}


def _seeded(cls):
    def make():
        torch.manual_seed(0)
        return cls()
    return make


def _hf(name):
    return lambda: hf_model(name)


def _data(name):
    return lambda i, rows: tokens(i, rows, name)


def _gc_gpt2():
    m = hf_model("gpt2")
    m.gradient_checkpointing_enable()  # HF's own checkpointing inside each block
    return m


def _cases():
    """name -> (make, loss_fn, data, steps, precisions, stages, Spec keywords)"""
    out = {k: (_seeded(cls), loss, data, 3, ("fp32",), STAGES, {}) for k, (cls, loss, data) in PLAIN.items()}
    out.update((k, (_hf(k), hf_loss, _data(k), 2, ("fp32", "bf16"), STAGES, {})) for k in HF)
    out["modernbert"] = (_hf("modernbert"), hf_loss, _data("modernbert"), 2, ("fp32",), (0, 3), {})
    out["gpt2_gc"] = (_gc_gpt2, hf_loss, _data("gpt2"), 2, ("fp32",), (0, 3), {})
    out["llama_tied"] = (_hf("llama_tied"), hf_loss, _data("llama_tied"), 2, ("fp32",), (0, 3), {})
    # every rank's rows pick experts 0 and 1 (every rank calls the same blocks): expert 2 is unused
    out["moe"] = (_seeded(MoE), moe_loss, lambda i, rows: routed(i, rows, (0, 1, 0, 1)), 3, ("fp32",), (0, 3),
                  {"skip_unused": True})
    return out


def _rank_rows(batch, rank, world):
    return {k: v.chunk(world)[rank] for k, v in batch.items()}


def _runs(rank, world):
    warnings.filterwarnings("ignore")
    out = {}
    for name, (make, loss_fn, data, steps, precisions, stages, kw) in _cases().items():
        for precision in precisions:
            for stage in stages:
                spec = fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=1e-2, weight_decay=0.01), loss_fn=loss_fn,
                               precision=precision, **kw)
                state = fz.init(make(), spec)
                losses = []
                for i in range(steps):
                    state, loss = fz.train_step(state, _rank_rows(data(i, world * ROWS), rank, world))
                    losses.append(float(loss))
                full = fz.full_params(state) if name in ("resnet", "moe") else {}
                out[name, precision, stage] = (losses, {n: b.clone() for n, b in state.buffers.items()}, full)
    spec = fz.Spec(stage=0, optimizer=fz.optim.adamw(lr=1e-2), loss_fn=xent, buffer_sync="rank0")
    state, _ = fz.train_step(fz.init(_seeded(TinyResNet)(), spec), _rank_rows(images(0, world * ROWS), rank, world))
    out["rank0"] = dict(state.buffers)
    for stage in (0, 3):  # rank 0 calls expert 0 only, rank 1 expert 1 only: the ranks' collectives pair up wrongly
        state = fz.init(_seeded(MoE)(), fz.Spec(stage=stage, loss_fn=moe_loss))
        try:
            fz.train_step(state, _rank_rows(routed(0, world * ROWS, (0, 1)), rank, world))
            out["split", stage] = None
        except fz.ConfigError as e:
            out["split", stage] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return cached_runs(2, _runs, timeout=400)


def test_every_model_follows_the_single_process_reference_at_every_stage(results):
    warnings.filterwarnings("ignore")
    for name, (make, loss_fn, data, steps, precisions, stages, _) in _cases().items():
        want, ref_sd = reference(make, loss_fn, [data(i, 2 * ROWS) for i in range(steps)], 2)
        for precision in precisions:
            tol = 1e-5 if precision == "fp32" else 2e-2
            for stage in stages:
                for rank, res in enumerate(results):
                    losses, buffers, full = res[name, precision, stage]
                    assert max_rel(losses, want) < tol, (name, precision, stage, rank, losses, want)
                    if name == "resnet":  # BatchNorm statistics: averaged over ranks, as the reference does
                        for n, b in buffers.items():
                            assert torch.allclose(b.double(), ref_sd[n].double(), rtol=1e-5, atol=1e-6), (stage, n)
                            assert torch.equal(b, results[0][name, precision, stage][1][n]), (stage, n, "ranks differ")
                        model = TinyResNet()
                        model.load_state_dict(full, strict=True)
                    if name == "moe":  # skip_unused: the expert no rank used is untouched, the others move
                        for n in full:
                            assert torch.allclose(full[n], ref_sd[n], rtol=1e-5, atol=1e-6), (stage, n)
                        assert torch.equal(full["experts.2.weight"], make().experts[2].weight.detach()), stage


def test_buffer_sync_rank0_takes_the_first_ranks_statistics(results):
    mean = results[0]["resnet", "fp32", 0][1]
    assert all(torch.equal(results[0]["rank0"][n], results[1]["rank0"][n]) for n in mean)
    chunk0 = _rank_rows(images(0, 2 * ROWS), 0, 2)
    model = _seeded(TinyResNet)()
    model(chunk0["x"])  # train mode: rank 0's rows update the statistics
    assert torch.allclose(results[1]["rank0"]["bn1.running_mean"], model.bn1.running_mean, atol=1e-7)


def test_ranks_that_call_different_blocks_fail_on_every_rank_instead_of_training_wrong(results):
    for res in results:
        for stage in (0, 3):
            msg = res["split", stage]
            assert msg is not None and "the ranks called different blocks" in msg, (stage, msg)
            assert "route inside a block" in msg
