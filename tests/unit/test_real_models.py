"""Real models as they are, one process: parents that read and iterate their blocks, checkpoints
inside blocks, train/eval modes, buffers (BatchNorm in bf16, donation, export with strict=True).
World 2 and the Hugging Face models: tests/multirank/test_real_models_dist.py."""
from __future__ import annotations

import pytest
import torch

import fz
from fz.ckpt.export import consolidate

from support.helpers import max_rel
from support.real_nets import (
    CheckpointsInside,
    MoE,
    Readers,
    ReadsWeight,
    TinyResNet,
    images,
    moe_loss,
    mse,
    points,
    reference,
    routed,
    xent,
)


def _spec(stage: int, loss_fn, **kw) -> fz.Spec:
    return fz.Spec(stage=stage, optimizer=fz.optim.adamw(lr=1e-2, weight_decay=0.01), loss_fn=loss_fn, **kw)


def _train(make, loss_fn, data, stage, steps=3, rows=8, **kw):
    state = fz.init(make(), _spec(stage, loss_fn, **kw))
    losses = []
    for i in range(steps):
        state, loss = fz.train_step(state, data(i, rows))
        losses.append(float(loss))
    return state, losses


def _seeded(cls, *args, **kw):
    def make():
        torch.manual_seed(0)
        return cls(*args, **kw)
    return make


def test_parents_read_iterate_unpack_and_index_their_blocks():
    want, _ = reference(_seeded(Readers), mse, [points(i, 8) for i in range(3)], 1)
    for stage in (0, 3):
        state, got = _train(_seeded(Readers), mse, points, stage)
        assert max_rel(got, want) < 1e-5, (stage, got, want)
    units = [u.name for u in state.skeleton.units]  # containers are looked into: their blocks are the units
    assert {"blocks.0", "pairs.0.0", "pairs.1.1", "dicts.0.attn", "dicts.1.ff"} <= set(units), units


def test_what_fz_holds_apart_is_a_config_error_naming_the_block_and_the_fix():
    state = fz.init(_seeded(ReadsWeight)(), _spec(3, mse))
    with pytest.raises(
        fz.ConfigError, match=r"reads parameter 'blocks.0.attn.weight' of block 'blocks.0'.*Spec\(wrap="
    ):
        fz.train_step(state, points(0, 8))
    seq = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), torch.nn.Linear(8, 1))
    state = fz.init(seq, fz.Spec(loss_fn=lambda m, b: sum(part(b).sum() for part in m[0])))
    with pytest.raises(fz.ConfigError, match=r"calls Linear '0.0', a part of block '0'.*Spec\(wrap="):
        fz.train_step(state, torch.randn(4, 8))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpoint_inside_a_block_recomputes_with_the_blocks_parameters(reentrant):
    want, _ = reference(_seeded(CheckpointsInside, reentrant), mse, [points(i, 8) for i in range(3)], 1)
    for stage in (0, 3):
        _, got = _train(_seeded(CheckpointsInside, reentrant), mse, points, stage)
        assert max_rel(got, want) < 1e-5, (stage, reentrant, got, want)


def test_train_step_trains_and_eval_step_and_apply_evaluate_whatever_the_mode_at_init():
    make = _seeded(TinyResNet)
    want, ref_sd = reference(make, xent, [images(i, 8) for i in range(2)], 1)
    model = make()
    model.eval()  # fz trains it in train mode all the same
    state = fz.init(model, _spec(3, xent))
    for i in range(2):
        state, loss = fz.train_step(state, images(i, 8))
        assert abs(float(loss) - want[i]) < 1e-5 * abs(want[i]), (i, float(loss), want[i])
    for n in ("bn1.running_mean", "layer1.1.bn2.running_var", "bn1.num_batches_tracked"):
        assert torch.allclose(state.buffers[n].float(), ref_sd[n].float(), rtol=1e-5, atol=1e-6), n

    dropped = _seeded(TinyResNet, p=0.5)()
    state = fz.init(dropped, _spec(0, xent))
    before = {n: b.clone() for n, b in state.buffers.items()}
    dropped.eval()
    batch = images(5, 8)
    # dropout off, running stats
    assert abs(float(fz.eval_step(state, batch)) - float(xent(dropped, batch).detach())) < 1e-6
    assert torch.allclose(fz.apply(state, batch["x"]), dropped(batch["x"]), atol=1e-6)
    dropped.train()
    with torch.random.fork_rng():
        torch.set_rng_state(state.rng)
        train_out = dropped(batch["x"])
    assert torch.allclose(fz.apply(state, batch["x"], train=True), train_out, atol=1e-6)  # the state's generator
    # no buffer changed by any of them
    assert [n for n, b in state.buffers.items() if not torch.equal(before[n], b)] == []


def test_donate_false_leaves_the_old_states_buffers_alone():
    state = fz.init(_seeded(TinyResNet)(), _spec(0, xent))
    before = {n: b.clone() for n, b in state.buffers.items()}
    new, _ = fz.train_step(state, images(0, 8), donate=False)
    assert all(torch.equal(before[n], b) for n, b in state.buffers.items())
    assert not torch.equal(new.buffers["bn1.running_mean"], before["bn1.running_mean"])
    assert int(new.buffers["bn1.num_batches_tracked"]) == 1


def test_batchnorm_in_bf16_at_stage_3_exports_with_strict_load_and_the_same_eval_outputs(tmp_path):
    want, ref_sd = reference(_seeded(TinyResNet), xent, [images(i, 8) for i in range(3)], 1)
    state, got = _train(_seeded(TinyResNet), xent, images, 3, precision="bf16")
    assert max_rel(got, want) < 2e-2, (got, want)
    for n in ("bn1.running_mean", "layer1.1.bn2.running_var"):  # updated in bf16, kept in fp32
        assert state.buffers[n].dtype == torch.float32
        assert torch.allclose(state.buffers[n], ref_sd[n], rtol=2e-2, atol=2e-3), n
    x = images(9, 8)["x"]
    full = fz.full_params(state)  # parameters and the state_dict's buffers (not the non-persistent ones)
    exported = TinyResNet()
    exported.load_state_dict(full, strict=True)
    exported.eval()
    assert torch.allclose(fz.apply(state, x).float(), exported(x), atol=3e-2, rtol=3e-2)

    fz.save(state, tmp_path / "ck")
    restored = fz.restore(fz.init(TinyResNet(), _spec(3, xent, precision="bf16")), tmp_path / "ck")
    assert all(torch.equal(restored.buffers[n], b) for n, b in state.buffers.items())  # saved once, restored
    consolidate(tmp_path / "ck", tmp_path / "m.safetensors")
    from safetensors.torch import load_file
    on_disk = load_file(tmp_path / "m.safetensors")
    again = TinyResNet()
    again.load_state_dict(on_disk, strict=True)  # fp32 master weights and the buffers
    again.eval()
    assert torch.allclose(fz.apply(state, x).float(), again(x), atol=3e-2, rtol=3e-2)
    fresh = fz.load_weights(fz.init(TinyResNet(), _spec(3, xent)), tmp_path / "m.safetensors")
    assert torch.equal(fresh.buffers["layer1.0.bn1.running_var"], state.buffers["layer1.0.bn1.running_var"])
    fp32 = TinyResNet()
    fp32.load_state_dict(fz.full_params(fresh), strict=True)
    fp32.eval()
    assert torch.allclose(fz.apply(fresh, x), fp32(x), atol=1e-6)  # fp32: the same outputs


def test_parameters_without_a_gradient_move_by_default_and_skip_unused_leaves_them_as_torch_does():
    want, ref_sd = reference(_seeded(MoE), moe_loss, [routed(i, 8) for i in range(3)], 1)
    start = _seeded(MoE)().state_dict()
    for stage in (0, 3):
        state, got = _train(_seeded(MoE), moe_loss, routed, stage, skip_unused=True)
        assert max_rel(got, want) < 1e-5, (stage, got, want)
        full = fz.full_params(state)
        for n in ("experts.1.weight", "experts.2.bias"):  # no row picked them: as torch, untouched
            assert torch.equal(full[n], start[n]) and torch.equal(ref_sd[n], start[n]), (stage, n)
        assert not torch.equal(full["experts.0.weight"], start["experts.0.weight"])
        moment = state.opt_state[0].mu["experts.1.weight"].full_tensor()
        assert not moment.any(), stage
        state, _ = _train(_seeded(MoE), moe_loss, routed, stage)  # default: a zero gradient (DeepSpeed)
        full = fz.full_params(state)
        assert not torch.equal(full["experts.1.weight"], start["experts.1.weight"]), stage  # weight decay moved it
