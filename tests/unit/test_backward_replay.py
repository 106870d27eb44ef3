"""Backward's first ops replayed on a traced graph (fz/planning/backward.py) against autograd's own
run of the same graph, its allocations read from torch.profiler; and the trace's CUDA loss."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action, Category, MemoryProfile

import fz
from fz.planning.activations import _CudaCrossEntropy
from fz.planning.backward import first_ops_peak
from fz.testing.gpt import GPT, GPTConfig, lm_loss

MARK = 12347  # float32 elements of the tensor that marks backward's start in the profiler's timeline


def _lm_head(x, w, y):
    return F.cross_entropy(x @ w, y)


def _mlp(x, w, y):
    h = F.gelu(x @ w)
    return F.mse_loss(h @ w.t(), x)


def _shared(x, w, y):
    """One tensor read by two ops: its gradient arrives twice and is summed."""
    h = (x * 2.0) @ w
    return (torch.tanh(h) * h.sigmoid()).sum() + F.cross_entropy(h, y)


def _storage(t):
    return t.untyped_storage()._cdata


def _replayed_and_measured(fn, autocast: bool, cuda_loss: bool) -> tuple[int, int]:
    """(the replay's peak above the forward's end, autograd's measured peak above the same point)."""
    torch.manual_seed(0)
    x = torch.randn(256, 48, requires_grad=True)
    w = torch.randn(48, 3000) * 0.1  # the logits, 256 x 3000, dwarf everything else
    y = torch.randint(0, 3000, (256,))
    saved: set = set()

    def pack(t):
        saved.add(_storage(t))
        return t

    policy = _CudaCrossEntropy() if cuda_loss else contextlib.nullcontext()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), policy, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn(x, w, y)
        unit_of = dict.fromkeys(saved - {_storage(x), _storage(w)}, "")
        replayed = first_ops_peak(loss, _storage, unit_of, lambda t: t.untyped_storage().nbytes())
        mark = torch.empty(MARK)
        loss.backward()
    del mark
    memory = MemoryProfile(prof.profiler.kineto_results)
    live, start, peak = 0, None, 0
    for _, action, (key, version), size in memory.timeline:
        if start is None and action == Action.CREATE and size == MARK * 4:
            start = peak = live
            continue
        if memory._categories.get(key, version) in (None, Category.GRADIENT):
            # no tensor's: a kernel's workspace (the CPU's bf16 matmul allocates an fp32 one), not
            # autograd's; or a leaf's .grad, which the estimate's gradient terms count
            continue
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        if start is not None:
            peak = max(peak, live)
    assert start is not None, "the profiler recorded no marker"
    return replayed, peak - start


@pytest.mark.parametrize("fn", [_lm_head, _mlp, _shared], ids=["lm-head", "mlp", "shared"])
@pytest.mark.parametrize("autocast, cuda_loss", [(False, False), (True, False), (True, True)],
                         ids=["fp32", "bf16-cpu", "bf16-cuda-loss"])
def test_the_replay_holds_what_autograd_holds(fn, autocast, cuda_loss):
    """The graph run as autograd runs it (its order, its frees): the bytes its backward holds
    above the forward's leftovers, as the replay counts them, within 1%."""
    replayed, measured = _replayed_and_measured(fn, autocast, cuda_loss)
    logits = 256 * 3000 * 4
    assert measured > logits / 2  # the measurement saw the logits' gradients
    assert abs(replayed - measured) <= 0.01 * measured, (replayed, measured)


def test_cudas_loss_holds_one_fp32_gradient_where_the_cpus_holds_two():
    """On a CPU, bf16 cross-entropy saves an fp32 log-softmax and its backward holds two fp32
    gradients beside it; CUDA's autocast saves a bf16 log-softmax and an fp32 copy and holds one."""
    logits = 256 * 3000 * 4
    cpu, _ = _replayed_and_measured(_lm_head, True, False)
    cuda, _ = _replayed_and_measured(_lm_head, True, True)
    assert cpu == pytest.approx(2 * logits, rel=0.01)
    assert cuda == pytest.approx(logits, rel=0.01)


def test_the_cuda_loss_computes_the_cross_entropy():
    """The trace's stand-in for CUDA's autocast computes what cross_entropy computes (to bf16's
    rounding), every argument honoured; what it does not model runs unchanged."""
    torch.manual_seed(0)
    x = torch.randn(64, 10, 5)
    y = torch.randint(0, 10, (64, 5))
    weight = torch.rand(10) + 0.5
    for kwargs in ({}, {"weight": weight}, {"reduction": "sum"}, {"reduction": "none", "ignore_index": 3}):
        with torch.autocast("cpu", dtype=torch.bfloat16), _CudaCrossEntropy():
            got = F.cross_entropy(x.bfloat16(), y, **kwargs)
        want = F.cross_entropy(x.bfloat16().float(), y, **kwargs)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    probs = torch.softmax(torch.randn(64, 10), 1)
    for args, kwargs in (((x.bfloat16(), y), {"label_smoothing": 0.1}), ((x[..., 0].bfloat16(), probs), {})):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = F.cross_entropy(*args, **kwargs)
        with torch.autocast("cpu", dtype=torch.bfloat16), _CudaCrossEntropy():
            got = F.cross_entropy(*args, **kwargs)
        assert torch.equal(got, want)


def test_the_estimate_traces_the_loss_as_the_device_it_names_keeps_it():
    """A GPT's traced activations and backward's first op, for a CUDA device and for this CPU:
    the logits' bf16 log-softmax more at the forward's end on CUDA, one fp32 gradient fewer at
    backward's first op (an H200's snapshot of a 2.8B GPT: benchmarks/RESULTS.md)."""
    cfg = GPTConfig(vocab=2048, seq=64, dim=32, heads=2, layers=2)
    with torch.device("meta"):
        model = GPT(cfg)
    spec = fz.Spec(stage=3, precision="bf16", loss_fn=lm_loss)
    cpu, cuda = (fz.estimate(model, spec=spec, micro_batch=4, seq_len=cfg.seq + 1, device_type=d)
                 for d in ("cpu", "cuda"))
    logits = 4 * cfg.seq * cfg.vocab * 4  # fp32
    assert cuda.activations - cpu.activations == logits // 2
    assert cpu.backward_start - cpu.activations == pytest.approx(2 * logits, rel=0.01)
    assert cuda.backward_start - cuda.activations == pytest.approx(logits, rel=0.01)
    assert "activations as cuda keeps them" in str(cuda).splitlines()[0]
    assert cpu.traced_for == "cpu" and fz.estimate(model, spec=spec).traced_for is None
    with pytest.raises(fz.ConfigError, match="device_type='gpu'.*\"cuda\" or \"cpu\""):
        fz.estimate(model, spec=spec, micro_batch=4, seq_len=cfg.seq + 1, device_type="gpu")
