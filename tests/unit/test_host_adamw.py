"""The host update's one-pass AdamW (fz/optim/kernel.py) computes what fz computed before it, bit for
bit: torch's fused AdamW over the fp32 masters, then the masters cast into the bf16 parameters.
Without a C++ compiler (or with FZ_HOST_KERNEL=0) the two passes run, and the same checks hold."""
from __future__ import annotations

import pytest
import torch

import fz
from fz.optim import kernel
from fz.optim.base import GradientTransformation, step_casting

from support.helpers import make_model, rank_batches, spec

HYPER = [(1e-3, (0.9, 0.999), 0.01), (3e-4, (0.8, 0.95), 0.1), (1e-2, (0.3, 0.99), 0.0)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _shards(sizes: list[int], offset: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp32 masters and bf16 parameters as views into one buffer each, from `offset` (an odd offset:
    unaligned views, the kernel's plain stores), as a bucket's parameters are."""
    gen = torch.Generator().manual_seed(seed)
    total = offset + sum(sizes)
    flat = torch.randn(total, generator=gen) * torch.logspace(-8, 3, total)
    low = torch.zeros(total, dtype=torch.bfloat16)
    masters, params, at = [], [], offset
    for n in sizes:
        masters.append(flat[at:at + n])
        params.append(low[at:at + n])
        at += n
    return masters, params


@pytest.mark.parametrize("mul", [None, 0.3718])
@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("lr,betas,decay", HYPER)
def test_one_pass_equals_torch_fused_then_cast(lr, betas, decay, offset, mul):
    """`mul`: a clip's factor, which the kernel applies as it reads each gradient: the bits of
    `_foreach_mul_` on the gradients before the step."""
    sizes = [1, 15, 16, 17, 4096 + 5, 300_001]
    names = [f"p{i}" for i in range(len(sizes))]
    opt = fz.optim.adamw(lr=lr, betas=betas, eps=1e-8, weight_decay=decay)
    masters, low = _shards(sizes, offset, seed=1)
    ref_p = [m.clone() for m in masters]
    ref_low = [t.clone() for t in low]
    ref_m = [torch.zeros_like(m) for m in masters]
    ref_v = [torch.zeros_like(m) for m in masters]
    state = opt.init(dict(zip(names, masters)))
    gen = torch.Generator().manual_seed(2)
    for count in range(1, 5):
        grads = [torch.randn(n, generator=gen) * 10.0 ** float(-count) for n in sizes]
        factor = None if mul is None else torch.tensor(mul)
        scaled = [g.clone() for g in grads]
        if factor is not None:  # before: the clip's pass over the gradients
            torch._foreach_mul_(scaled, factor)
        # before: torch's fused AdamW (what _FusedAdamW.step ran), then the cast copy of the masters
        torch._fused_adamw_(ref_p, scaled, ref_m, ref_v, [], [torch.tensor(float(count))] * 6,
                            lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=decay, eps=1e-8, amsgrad=False,
                            maximize=False)
        for t, p in zip(ref_low, ref_p):
            t.copy_(p)
        state = opt.step(dict(zip(names, grads)), state, dict(zip(names, masters)), donate=True,
                         cast=dict(zip(names, low)), grad_mul=factor)
    adam = state[0]
    for i, k in enumerate(names):
        assert torch.equal(_bits(masters[i]), _bits(ref_p[i])), k
        assert torch.equal(_bits(adam.mu[k]), _bits(ref_m[i])), k
        assert torch.equal(_bits(adam.nu[k]), _bits(ref_v[i])), k
        assert torch.equal(_bits(low[i]), _bits(ref_low[i])), k


def test_the_kernel_runs_where_it_can(monkeypatch):
    """Where the kernel builds, it agrees with torch (else it is not used) and the update's pass is its."""
    if kernel._library() is None:
        assert kernel.why_not != "disagrees with torch"
        pytest.skip(f"fz's host AdamW kernel is not used here ({kernel.why_not}): the update casts in a second pass")
    used = []
    real = kernel._run
    monkeypatch.setattr(kernel, "_run", lambda found, *a: used.append(found is not None) or real(found, *a))
    test_one_pass_equals_torch_fused_then_cast(*HYPER[0], offset=0, mul=None)
    test_one_pass_equals_torch_fused_then_cast(*HYPER[0], offset=0, mul=0.5)
    assert used and all(used)
    monkeypatch.setenv("FZ_HOST_KERNEL", "0")
    used.clear()
    test_one_pass_equals_torch_fused_then_cast(*HYPER[0], offset=0, mul=None)
    assert used and not any(used)


def _train(policy, steps: int = 3, clip: float = 1.0):
    state = fz.init(make_model(), spec(3, 1, precision="bf16", offload=policy, clip_grad_norm=clip))
    for per_rank in rank_batches(1, 1, steps):
        state, _ = fz.train_step(state, per_rank[0])
    out = {k: v.clone() for k, v in fz.full_params(state).items()}
    out.update({"master/" + k: v._local_tensor.clone() for k, v in (state.master or {}).items()})
    return out


@pytest.mark.parametrize("clip", [1.0, 1e-3])
@pytest.mark.parametrize("policy", ["none", "cpu", "cpu-params"])
def test_train_steps_agree_with_the_two_pass_update(policy, clip, monkeypatch):
    """bf16 with fp32 masters at world 1, several steps: the same bits with the kernel and without;
    with a clip that scales every step's gradients (1e-3), whose factor the kernel applies in its pass."""
    make = {"none": fz.offload.none, "cpu": fz.offload.cpu, "cpu-params": lambda: fz.offload.cpu(params=True)}[policy]
    fast = _train(make(), clip=clip)
    monkeypatch.setenv("FZ_HOST_KERNEL", "0")
    slow = _train(make(), clip=clip)
    assert fast.keys() == slow.keys()
    for k in fast:
        assert torch.equal(_bits(fast[k]), _bits(slow[k])), k


def test_a_step_without_cast_gets_the_copy_after():
    """A transformation whose own `step` takes no `cast=` (a user's) still has its parameters cast."""

    class Plain(GradientTransformation):
        def step(self, grads, state, params, **extra):  # noqa: ANN001, ANN003, ANN201 - a user's override
            return GradientTransformation.step(self, grads, state, params, **extra)

    sgd = fz.optim.sgd(lr=0.5)
    tx = Plain(sgd.init, sgd.update)
    params = {"w": torch.ones(5)}
    low = {"w": torch.zeros(5, dtype=torch.bfloat16)}
    step_casting(tx, {"w": torch.ones(5)}, tx.init(params), params, low)
    assert torch.equal(low["w"], torch.full((5,), 0.5, dtype=torch.bfloat16))


@pytest.mark.parametrize("optimizer", ["adamw", "lion"])
def test_cast_groups_are_each_closed_after_their_update_and_before_the_next(monkeypatch, optimizer):
    """A bucket's parameters are cast as its update ends, and said to be done (`close`: their copy
    to the GPU starts there) before the next bucket is updated: AdamW's host kernel runs once per
    group in order; another optimizer casts after its whole update, group by group. Either way the
    same bits as one cast of everything after the update."""
    from fz.optim import aliases
    from fz.optim.base import CastGroups

    sizes = [37, 5, 129, 64, 3]
    names = [f"p{i}" for i in range(len(sizes))]
    tx = fz.optim.adamw(lr=1e-2, weight_decay=0.1) if optimizer == "adamw" else fz.optim.lion(lr=1e-3)
    runs, real = {}, aliases.adamw_
    for grouped in (False, True):
        masters, low = _shards(sizes, 3, seed=1)
        params = dict(zip(names, masters))
        targets = dict(zip(names, low))
        state, log = tx.init(params), []
        monkeypatch.setattr(aliases, "adamw_",
                            lambda ps, *a, log=log, **k: (log.append(("update", len(ps))), real(ps, *a, **k)))
        groups = [names[:2], names[2:3], names[3:]]

        def open_(i, groups=groups, targets=targets, log=log):
            log.append(("open", i))
            return {k: targets[k] for k in groups[i]}

        cast = CastGroups(groups, open_, lambda i, log=log: log.append(("close", i))) if grouped else None
        for seed in range(3):
            gen = torch.Generator().manual_seed(10 + seed)
            grads = {k: torch.randn(n, generator=gen) for k, n in zip(names, sizes)}
            state = step_casting(tx, grads, state, params, {} if grouped else targets, torch.tensor(0.5), cast)
        runs[grouped] = ([m.clone() for m in masters], [t.clone() for t in low], log)
    (m0, l0, _), (m1, l1, log) = runs[False], runs[True]
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(m0 + l0, m1 + l1))
    if optimizer == "adamw":  # in the update's own pass: each group updated between its open and close
        assert log == [("open", 0), ("update", 2), ("close", 0), ("open", 1), ("update", 1), ("close", 1),
                       ("open", 2), ("update", 2), ("close", 2)] * 3
    else:  # no host kernel: cast after the update, still a group at a time, each closed before the next opens
        assert log == [("open", 0), ("close", 0), ("open", 1), ("close", 1), ("open", 2), ("close", 2)] * 3


class _OneUsed(torch.nn.Module):
    """Two layers; the loss reads only the first, so `Spec.skip_unused` leaves the second as it was."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_skipped_parameters_keep_their_bf16_values():
    """The update writes the bf16 parameters as it goes; those `skip_unused` puts back are cast back too."""
    start = _OneUsed().state_dict()
    for policy in (fz.offload.none(), fz.offload.cpu(params=True)):
        state = fz.init(_OneUsed(), fz.Spec(stage=3, precision="bf16", skip_unused=True, offload=policy,
                                            optimizer=fz.optim.adamw(lr=0.1, weight_decay=0.5),
                                            loss_fn=lambda model, x: model(x).square().mean()))
        for i in range(2):
            state, _ = fz.train_step(state, torch.randn(4, 16, generator=torch.Generator().manual_seed(i)))
        masters, low = fz.full_params(state), fz.full_params(state, "compute")
        for k in ("unused.weight", "unused.bias"):
            assert torch.equal(masters[k], start[k]), (policy, k)
            assert low[k].dtype == torch.bfloat16 and torch.equal(low[k], start[k].to(torch.bfloat16)), (policy, k)
        assert not torch.equal(masters["used.weight"], start["used.weight"])


def test_init_starts_the_kernel_build_where_the_update_runs_on_the_host(monkeypatch):
    """fz.init starts the kernel's build in the background where the update will run on the host (a
    CPU machine, or the optimizer offloaded) in mixed precision: on a GPU its compile then overlaps
    the init, not the first step (benchmarks/RESULTS.md); the first step finds it built."""
    monkeypatch.setattr(kernel, "_READY", None)
    fz.init(make_model(), spec(3, 1, precision="fp32", offload=fz.offload.cpu()))
    assert kernel._READY is None  # fp32: no parameters to cast, the kernel is not used
    state = fz.init(make_model(), spec(3, 1, precision="bf16", offload=fz.offload.cpu(params=True)))
    assert kernel._READY is not None
    assert kernel._READY.result() is kernel._library()
    state, loss = fz.train_step(state, rank_batches(1, 1, 1)[0][0])
    assert torch.isfinite(loss)


def test_code_is_loaded_only_from_a_cache_no_one_else_can_write(tmp_path, monkeypatch):
    """A kernel cache others can write (a shared FZ_KERNEL_CACHE) is not used: a library planted
    there would run as this user. In a private cache a file others can write is built again."""
    found = kernel._library()
    if found is None:
        pytest.skip(f"fz's host AdamW kernel is not used here ({kernel.why_not})")
    real = found[0]._name
    monkeypatch.setattr(kernel, "_command", lambda cxx, capability, out: ["cp", real, out])  # a build, in no time
    cxx, capability = kernel.compiler(), torch.backends.cpu.get_cpu_capability()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("FZ_KERNEL_CACHE", str(shared))
    built = kernel._build(cxx, capability)
    assert not built.is_relative_to(shared) and list(shared.iterdir()) == []
    private = tmp_path / "private"
    monkeypatch.setenv("FZ_KERNEL_CACHE", str(private))
    lib = kernel._build(cxx, capability)
    assert lib.parent == private and kernel._ours(lib) and (private.stat().st_mode & 0o777) == 0o700
    lib.write_bytes(b"planted")
    lib.chmod(0o666)
    assert kernel._build(cxx, capability) == lib and lib.read_bytes() != b"planted" and kernel._ours(lib)
