"""Meta init never trains on garbage: what reset_parameters() leaves unset is named, init_fn fills it.

(Replicated values that differ between ranks are checked at world 2 in test_agreement.py.)
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fz
from fz.model.materialize import _fill, still_filled


class Scaled(nn.Module):
    """A Linear whose extra `gain` is set only in __init__ (reset_parameters does not touch it)."""

    def __init__(self, n: int = 8):
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.gain = nn.Parameter(torch.ones(n))

    def reset_parameters(self) -> None:  # nothing of its own: the Linear child has its own turn
        pass

    def forward(self, x):
        return self.lin(x) * self.gain


class Rope(nn.Module):
    """A RoPE-like table computed in __init__; no reset_parameters."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x):
        return x * self.inv_freq.repeat(2)


class RopeWithReset(Rope):
    """torchtune's way: reset_parameters() recomputes the table, so meta init works."""

    def reset_parameters(self) -> None:
        dim = 2 * self.inv_freq.numel()
        self.inv_freq.copy_(1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))


class Net(nn.Module):
    def __init__(self, rope=Rope):
        super().__init__()
        self.rope = rope()
        self.blocks = nn.ModuleList(Scaled() for _ in range(2))
        self.mask = nn.Module()
        self.mask.register_buffer("keep", torch.tril(torch.ones(4, 4)).bool())  # a bool buffer from __init__
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        x = self.rope(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x).mean() + 0 * self.mask.keep.sum()


def _meta(**kw) -> Net:
    with torch.device("meta"):
        return Net(**kw)


def test_tensors_meta_init_leaves_unset_are_named_with_what_to_do():
    with pytest.raises(fz.ConfigError) as e:
        fz.init(_meta(), fz.Spec(stage=3))
    msg = str(e.value)
    for name in ("'blocks.0.gain'", "'blocks.1.gain'", "'rope.inv_freq'", "'mask.keep'"):
        assert name in msg, (name, msg)
    assert "parameter 'blocks.0.gain': not set by Scaled.reset_parameters()" in msg
    assert "buffer 'rope.inv_freq': not set: Rope has no reset_parameters()" in msg
    assert "Spec(init_fn=" in msg and "build the model on the CPU" in msg
    assert "'blocks.0.lin.weight'" not in msg and "'head.bias'" not in msg  # reset_parameters set those


def test_init_fn_and_a_recomputing_reset_parameters_fill_them_with_the_cpu_values():
    torch.manual_seed(0)
    cpu = Net(rope=RopeWithReset)

    def init_fn(name: str, module: nn.Module) -> None:
        if isinstance(module, Scaled):
            module.gain.fill_(1.0)
        if name == "mask":
            module.keep.copy_(torch.tril(torch.ones(4, 4)).bool())

    for stage in (0, 3):
        state = fz.init(_meta(rope=RopeWithReset), fz.Spec(stage=stage, init_fn=init_fn))
        params = fz.full_params(state)
        assert torch.equal(params["blocks.1.gain"], torch.ones(8))
        assert torch.equal(state.buffers["rope.inv_freq"], cpu.rope.inv_freq)
        assert torch.equal(state.buffers["mask.keep"], cpu.mask.keep)
        state, loss = fz.train_step(state, torch.randn(4, 8))
        assert torch.isfinite(loss)


def test_a_partly_set_tensor_is_named_with_the_count():
    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))

        def reset_parameters(self):
            self.w[:2].fill_(0.5)  # the other two rows stay uninitialised

        def forward(self, x):
            return (x @ self.w).mean()

    with torch.device("meta"):
        m = Half()
    with pytest.raises(fz.ConfigError, match=r"parameter 'w': 8 of 16 elements not set by Half.reset_parameters\(\)"):
        fz.init(m, fz.Spec())


def test_the_sentinel_is_no_value_arithmetic_makes():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64):
        made = torch.tensor([0.0, float("nan"), float("inf"), -1.0], dtype=dtype)
        made = torch.cat([made, made * 0 / 0, torch.sqrt(-made.abs() - 1), made.exp() * float("inf")])
        assert not still_filled(made).any(), (dtype, made)
        filled = _fill(torch.empty(3, dtype=dtype), False)
        assert still_filled(filled).all() and not still_filled(filled * 1).any(), dtype  # arithmetic quiets it
    assert not still_filled(torch.tensor([-1, 0, 1, 2**31 - 1], dtype=torch.int32)).any()


def _hf_meta_params(rank, world):
    """GPT-2 and Llama built on meta, initialised by fz at stage 3: full values and buffers."""
    import warnings
    warnings.filterwarnings("ignore")
    from support.real_nets import hf_model
    out = {}
    for name in ("gpt2", "llama"):
        with torch.device("meta"):
            model = hf_model(name)
        state = fz.init(model, fz.Spec(stage=3))
        out[name] = (fz.full_params(state), dict(state.buffers))
    return out


def test_a_hugging_face_model_on_meta_gets_its_own_init_the_same_at_every_world_size():
    pytest.importorskip("transformers")
    from fz.testing.spawn import run_ranks

    from support.real_nets import hf_model
    one = _hf_meta_params(0, 1)
    two = run_ranks(2, _hf_meta_params, timeout=180)
    for name in ("gpt2", "llama"):
        params, buffers = one[name]
        for res in two:
            assert params.keys() == res[name][0].keys()
            assert all(torch.equal(params[k], res[name][0][k]) for k in params), name  # world-size invariant
        cpu = hf_model(name)  # what HF's own init gives on the CPU: the same statistics and tables
        for k, v in cpu.named_parameters():
            got, want = params[k], v.detach()
            if want.std() > 0:
                assert abs(float(got.std()) / float(want.std()) - 1) < 0.15, (
                    name,
                    k,
                    float(got.std()),
                    float(want.std()),
                )
            else:
                assert torch.equal(got, want), (name, k)  # norms' ones, biases' zeros
        for k, v in cpu.named_buffers():
            assert torch.equal(buffers[k], v), (name, k)  # Llama's RoPE table, from HF's init
    gpt2 = one["gpt2"][0]
    # GPT-2's scaled residual init
    assert abs(float(gpt2["transformer.h.0.attn.c_proj.weight"].std()) - 0.02 / 2) < 2e-3
    assert abs(float(gpt2["transformer.wte.weight"].std()) - 0.02) < 2e-3


def test_torchs_own_attention_and_encoder_initialise_on_meta_as_on_the_cpu():
    """nn.MultiheadAttention has no reset_parameters(), only torch's private _reset_parameters(),
    which also zeroes its child out_proj's bias: fz runs both, as building on the CPU does."""
    def make():
        layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, batch_first=True, dropout=0.0)
        return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(32, 3))

    with torch.device("meta"):
        model = make()
    loss_fn = lambda m, b: nn.functional.cross_entropy(m(b["x"]).mean(1), b["y"])  # noqa: E731
    state = fz.init(model, fz.Spec(stage=3, loss_fn=loss_fn))
    got, cpu = fz.full_params(state), dict(make().named_parameters())
    assert got.keys() == cpu.keys()
    for name in cpu:
        a, b = got[name].float(), cpu[name].detach()
        if "bias" in name and "linear" not in name and not name.startswith("1."):  # attention and norm biases: 0
            assert bool((a == b).all()), name
        elif b.numel() >= 256:  # the same distribution (fz draws each module from its own seed)
            assert abs(float(a.std()) - float(b.std())) < 0.25 * float(b.std()) + 1e-6, name
    assert float(got["0.layers.0.self_attn.out_proj.bias"].abs().max()) == 0.0  # the parent's init ran
    batch = {"x": torch.randn(4, 5, 32), "y": torch.randint(0, 3, (4,))}
    state, loss = fz.train_step(state, batch)
    assert torch.isfinite(loss)
