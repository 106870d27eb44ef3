"""fz on one CUDA GPU: the CPU's results, the estimate's device bytes, transfers that wait for their events.

Skipped, naming why, where torch.cuda.is_available() is false (CI and the development
machines have no GPU); run on a GPU with `pytest -m cuda tests/cuda`. World 1 unless
said: NCCL refuses two ranks on one device, so world 2 runs through gloo (below).
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch

import fz
import fz.offload.transfer as transfer
from fz.testing.gpt import GPT, GPTConfig, lm_loss, synthetic_tokens

from support import cuda_jobs

HERE = os.path.dirname(__file__)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() "
                                 "is false): the CUDA tests run on a machine with a GPU")]

TOL = {"fp32": 1e-4, "bf16": 3e-2}  # relative; other kernels (cuBLAS vs the CPU's) round differently


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cpu"))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="4")
    out = subprocess.run([sys.executable, os.path.join(HERE, "..", "support", "cuda_jobs.py"), root], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gpu_losses(tmp_path_factory):
    return cuda_jobs.losses(str(tmp_path_factory.mktemp("gpu")))


@pytest.mark.parametrize("case", cuda_jobs.cases(), ids=["-".join(map(str, c)) for c in cuda_jobs.cases()])
def test_losses_equal_the_cpu_run(cpu_reference, gpu_losses, case):
    stage, kind, params, precision = case
    key = f"{stage}-{kind}-{params}-{precision}"
    want, got = cpu_reference[key], gpu_losses[key]
    if isinstance(want, str):  # a configuration fz refuses (offload at stage 0): refused alike on the GPU
        assert got == want and stage == 0 and kind != "none"
        return
    assert got[-1] < got[0], got  # it trains
    for a, b in zip(got, want):
        assert abs(a - b) <= TOL[precision] * abs(b), (key, got, want)


def _warm_up(spec: fz.Spec) -> None:
    """One step of a tiny model first: what the process allocates once (cuBLAS's workspace for
    each thread that runs a matmul, forward's and autograd's: 2 x 32 MiB on an H100) is not the
    configuration's memory."""
    tiny = GPTConfig(vocab=64, seq=8, dim=16, heads=2, layers=2)
    state = fz.init(GPT(tiny), spec)
    state, loss = fz.train_step(state, synthetic_tokens(2, tiny.seq, tiny.vocab, seed=0))
    float(loss)
    del state, loss


def _peak(spec: fz.Spec, cfg: GPTConfig, micro: int) -> tuple:
    """(torch.cuda.max_memory_allocated above what was allocated before fz.init, fz.estimate's per_device)."""
    with torch.device("meta"):
        model = GPT(cfg)
    est = fz.estimate(model, spec=spec, micro_batch=micro, seq_len=cfg.seq + 1)
    _warm_up(spec)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    state = fz.init(model, spec)
    data = synthetic_tokens(3 * micro, cfg.seq, cfg.vocab)
    for i in range(3):
        state, loss = fz.train_step(state, data[i * micro:(i + 1) * micro])
    float(loss)
    report = fz.memory_report(state)
    peak = torch.cuda.max_memory_allocated() - base
    assert report.device_peak == torch.cuda.max_memory_allocated()  # memory_report carries it
    del state
    return peak, est.per_device


BIG = GPTConfig(vocab=8192, seq=256, dim=1024, heads=16, layers=8)  # ~117M parameters: states dwarf the noise


@pytest.mark.parametrize("stage, offload", [(3, "params"), (3, "optimizer"), (2, "optimizer"), (3, "none")])
def test_device_peak_within_10_percent_of_the_estimate(stage, offload):
    policy = {"params": fz.offload.cpu(params=True), "optimizer": fz.offload.cpu(), "none": None}[offload]
    spec = fz.Spec(stage=stage, precision="bf16", loss_fn=lm_loss, offload=policy, clip_grad_norm=1.0)
    peak, predicted = _peak(spec, BIG, micro=4)
    assert abs(peak - predicted) <= 0.10 * peak, (stage, offload, peak, predicted)


LOSSY = GPTConfig(vocab=50304, seq=1024, dim=256, heads=4, layers=4)  # the headline's loss on small blocks


def test_a_loss_dominated_peak_within_10_percent_of_the_estimate():
    """The 2.8B headline's loss (4 x 1024 tokens over 50,304 words: 786 MiB of fp32 logits) with
    small checkpointed blocks: the device's peak is backward's first op, where CUDA's autocast keeps
    a bf16 log-softmax, an fp32 copy of it and one fp32 gradient; the estimate traces it so (1.96 GiB).
    Traced as the CPU keeps it (an fp32 log-softmax, two fp32 gradients) it said 2.34 GiB."""
    spec = fz.Spec(stage=3, precision="bf16", loss_fn=lm_loss, offload=fz.offload.cpu(params=True),
                   clip_grad_norm=1.0, activation_checkpointing=True)
    peak, predicted = _peak(spec, LOSSY, micro=4)
    assert abs(peak - predicted) <= 0.10 * peak, (peak, predicted)


def test_no_gradient_stays_on_the_device_with_offload():
    """Optimizer and parameters on the host: the device holds less than one bf16 copy of the gradients
    (2 bytes a parameter), where keeping them there would take that and more."""
    spec = fz.Spec(stage=3, precision="bf16", loss_fn=lm_loss, offload=fz.offload.cpu(params=True))
    peak, _ = _peak(spec, BIG, micro=1)
    plain, _ = _peak(spec.replace(offload=None), BIG, micro=1)
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(BIG).parameters())
    assert peak < 2 * n < plain - 2 * n, (peak, plain, n)


def _run(spec, steps=3, seed=0):
    from support.helpers import make_model, rank_batches
    state = fz.init(make_model(seed), spec)
    out = []
    for b in rank_batches(1, 1, steps):
        state, loss = fz.train_step(state, b[0])
        out.append(float(loss))
    return out, {k: v.cpu().clone() for k, v in fz.full_params(state).items()}


@pytest.mark.parametrize("offload", ["params", "optimizer"])
def test_a_slow_copy_stream_changes_no_result(offload):
    """A long kernel queued on the copy stream before every transfer: a buffer read before its
    copy's event would hold stale or partial values, and the results would differ."""
    from support.helpers import spec as make_spec
    policy = fz.offload.cpu(params=offload == "params")
    sp = make_spec(3 if offload == "params" else 2, 1, precision="bf16", offload=policy)
    want = _run(sp)
    slowed = []
    transfer.before_copy = lambda stream: (slowed.append(1), torch.cuda._sleep(5_000_000))
    try:
        got = _run(sp)
    finally:
        transfer.before_copy = None
    assert slowed, "no transfer went through the copy stream"
    assert got[0] == want[0]
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])


def test_each_bucket_is_copied_up_while_the_next_is_updated(monkeypatch):
    """The optimizer on the host, the parameters on the GPU (stage 2): each bucket's bf16 values are
    written by the host kernel into pinned staging and copied up as soon as that bucket is updated,
    while the host updates the next (fz/offload/landing.py). A slow copy stream changes no result,
    and the results are those of the cast and copy after the whole update (the path before)."""
    import fz.step.updaters as updaters
    from fz.optim import aliases

    from support.helpers import spec as make_spec
    sp = make_spec(2, 1, precision="bf16", offload=fz.offload.cpu(), bucket_mb=0.02)  # several buckets
    real = updaters.landing_for
    monkeypatch.setattr(updaters, "landing_for", lambda *a: None)
    want = _run(sp)
    monkeypatch.setattr(updaters, "landing_for", real)
    log: list[str] = []
    kernel = aliases.adamw_
    monkeypatch.setattr(aliases, "adamw_", lambda *a, **k: (log.append("update"), kernel(*a, **k)))
    transfer.before_copy = lambda stream: (log.append("copy"), torch.cuda._sleep(5_000_000))
    try:
        got = _run(sp)
    finally:
        transfer.before_copy = None
    assert got[0] == want[0]
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])
    updates = [i for i, what in enumerate(log) if what == "update"]
    assert len(updates) > 3 and any(log[i + 1] == "copy" for i in updates[:-1]), log  # a copy between updates


@pytest.mark.parametrize("copies", [1, 2])
def test_widening_on_the_device_changes_no_result(copies):
    """host_grads.WIDEN="device": each bf16 gradient is widened before its copy, and the first
    micro-batch's fp32 staging buffer becomes the bucket's host buffer. It must stay out of the
    pool while it is (an H200 run gave it back, another bucket's copy overwrote it: loss 8.3 -> 12.7).
    Widening is exact either way, so the results are the host's bit for bit."""
    from fz.offload import host_grads

    from support.helpers import spec as make_spec
    sp = make_spec(3, 2, precision="bf16", offload=fz.offload.cpu(params=True))
    want = _run(sp)
    saved = host_grads.WIDEN, host_grads.MAX_COPIES
    host_grads.WIDEN, host_grads.MAX_COPIES = "device", copies
    try:
        got = _run(sp)
    finally:
        host_grads.WIDEN, host_grads.MAX_COPIES = saved
    assert got[0] == want[0]
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])


def test_pinned_buffers_are_bounded_and_reported():
    from support.helpers import spec as make_spec
    transfer._POOLS.clear()
    _run(make_spec(2, 1, offload=fz.offload.cpu(max_pinned_mb=0.001)))
    assert transfer.pinned_bytes() <= 0.001 * 2**20
    _run(make_spec(2, 1, offload=fz.offload.cpu()))
    assert transfer.pinned_bytes() > 0
    from support.helpers import make_model
    state = fz.init(make_model(), make_spec(2, 1, offload=fz.offload.cpu()))
    assert fz.memory_report(state).pinned == transfer.pinned_bytes()


def test_dropout_resumes_bit_identically(tmp_path):
    """Dropout on the GPU draws from the CUDA generator: the state and checkpoints carry it."""
    cfg = GPTConfig(dropout=0.2)
    data = synthetic_tokens(8, cfg.seq, cfg.vocab)
    sp = fz.Spec(stage=3, loss_fn=lm_loss)
    torch.manual_seed(0)
    state = fz.init(GPT(cfg), sp)
    for i in range(2):
        state, _ = fz.train_step(state, data[2 * i:2 * i + 2])
    fz.save(state, str(tmp_path / "ck"))
    fz.wait_for_checkpoints()
    want = []
    for i in range(2, 4):
        state, loss = fz.train_step(state, data[2 * i:2 * i + 2])
        want.append(float(loss))
    torch.manual_seed(123)
    torch.cuda.manual_seed(123)  # the process's generators elsewhere change nothing
    restored = fz.restore(fz.init(GPT(cfg), sp), str(tmp_path / "ck"))
    got = []
    for i in range(2, 4):
        restored, loss = fz.train_step(restored, data[2 * i:2 * i + 2])
        got.append(float(loss))
    assert got == want
    assert restored.rng.numel() > torch.get_rng_state().numel()  # the CUDA generator's part is there


def test_world_2_on_one_gpu_through_gloo():
    from fz.testing.spawn import run_ranks
    try:
        out = run_ranks(2, cuda_jobs.gloo_world2, 2, timeout=300)
    except RuntimeError as e:
        last = [line for line in str(e).splitlines() if line.strip()][-3:]
        if any("gloo" in line.lower() for line in last):  # gloo's own refusal of a CUDA collective
            pytest.skip("gloo's collectives do not take these CUDA tensors (NCCL refuses two ranks on one GPU): "
                        + " | ".join(last)[:400])
        raise
    (dev0, l0), (dev1, l1) = out
    assert dev0.startswith("cuda") and l0 == l1 and l0[-1] < l0[0]


def test_offloaded_state_is_pinned_at_its_exact_size():
    """Host state carved from slabs: pinned (copies overlap) and not rounded up tensor by tensor."""
    from support.helpers import make_model
    from support.helpers import spec as make_spec
    state = fz.init(make_model(), make_spec(3, 1, offload=fz.offload.cpu(params=True)))
    host = [f._local_tensor for f in state.param_flats if f._local_tensor.device.type == "cpu"]
    assert host and all(t.is_pinned() for t in host)
    assert len({t.untyped_storage().data_ptr() for t in host}) < len(host)


def test_hf_trainer_on_cuda_equals_transformers_trainer(tmp_path):
    """fz.hf.Trainer at ZeRO-3 on the GPU (world 1) against transformers' own Trainer on the same GPU."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import transformers

    import fz.hf

    from support.hf_trainer_jobs import ZERO3, Tokens, arguments, gpt2, losses
    ref = transformers.Trainer(model=gpt2(), args=arguments(str(tmp_path / "ref"), False, use_cpu=False),
                               train_dataset=Tokens())
    ref.train()
    ours = fz.hf.Trainer(model=gpt2(), args=arguments(str(tmp_path / "fz"), True, use_cpu=False, deepspeed=ZERO3),
                         train_dataset=Tokens())
    ours.train()
    assert ours.fz_state.plan.device.type == "cuda"
    assert losses(ours) == pytest.approx(losses(ref), rel=TOL["fp32"])


@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_engine_on_cuda_is_train_steps_step(stage):
    """fz.deepspeed on the GPU: engine(batch) / backward / step give fz.train_step's state bit for bit
    (the same phases), the script moving each batch to `engine.device` as DeepSpeed scripts do. fp32:
    the script computes its loss outside the engine, so in bf16 its cross-entropy runs without the
    autocast train_step's loss_fn has (a different, equally valid rounding)."""
    import fz.deepspeed as deepspeed
    cfg = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=2)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": stage},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=GPT(cfg), config=ds)
    torch.manual_seed(0)
    state = fz.init(GPT(cfg), fz.Spec.from_deepspeed(ds).replace(loss_fn=lambda m, b: lm_loss(m, b)))
    assert engine.device.type == "cuda"
    for step in range(3):
        tokens = synthetic_tokens(4, cfg.seq, cfg.vocab, seed=step)
        for micro in tokens.split(2):
            micro = micro.to(engine.device)  # a DeepSpeed script moves its batch (engine(x) does not)
            engine.backward(lm_loss(lambda x: engine(x), micro))
            engine.step()
        state, _ = fz.train_step(state, tokens)
    for name, w in fz.full_params(state).items():
        assert torch.equal(fz.full_params(engine.state)[name], w), name
