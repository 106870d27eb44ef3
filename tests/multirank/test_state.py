"""State is a true value: its leaves are the truth, reading it never communicates, nothing is shared.

One world-2 spawn runs the checks that need parameters in flight (stages 1-2 all-gather
after the update while the next forward runs); the tests assert on what the ranks returned.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Replicate

import fz
from fz.sharding.sync import local_data
from fz.testing.spawn import run_ranks

from support.helpers import LR, make_model, rank_batches, spec

COLLECTIVES = ("all_reduce", "broadcast", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor", "isend", "irecv", "send", "recv", "barrier", "all_gather_object",
               "all_gather", "reduce_scatter", "all_to_all_single")


def _arriving(state) -> int:
    return sum(local_data(f._local_tensor)[1] is not None for f in state.param_flats)


class _Count:
    """Counts calls of torch.distributed's collectives while active."""

    def __init__(self):
        self.calls, self.saved = [], {}

    def __enter__(self):
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self.saved[name] = fn
                setattr(dist, name, lambda *a, _n=name, _f=fn, **k: (self.calls.append(_n), _f(*a, **k))[1])
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _in_flight(rank, world):
    out = {}
    batches = rank_batches(world, 1, 3)
    for stage in (1, 2):
        sp = spec(stage, 1)
        s1, _ = fz.train_step(fz.init(make_model(), sp), batches[0][rank])
        s2, _ = fz.train_step(fz.init(make_model(), sp), batches[0][rank])  # another init of the same spec
        before = _arriving(s1)
        with _Count() as c:
            leaves, treedef = pytree.tree_flatten(s1)
            back = pytree.tree_unflatten(leaves, treedef)
            mapped = pytree.tree_map(lambda a, b: a, s1, s2)  # two states of one spec share a treedef
            shapes = pytree.tree_map(lambda x: tuple(x.shape) if isinstance(x, torch.Tensor) else x, s1)
            text = repr(s1) + repr(s1.params["wte.weight"]._local_tensor)
            names = sorted(s1.params)  # views by name: no wait
            after_reads = _arriving(s1)
            clone = copy.deepcopy(s1)  # copies values: waits for the gathers already started, starts none
        out["flight", stage] = (before, after_reads, _arriving(clone), c.calls, type(back).__name__,
                                type(mapped).__name__, len(names), "arriving" in text, shapes.step)
        # every way of reading the values sees them whole
        whole = (fz.full_params(clone), fz.full_params(s1))
        nxt, loss = fz.train_step(back, batches[1][rank])  # `back` shares s1's leaves: s1's buffers go with it
        out["values", stage] = (*whole, float(loss))
    # donate=False twice from one state: identical new states, the original unchanged
    for stage in (1, 3):
        s = fz.init(make_model(), spec(stage, 1))
        s, _ = fz.train_step(s, batches[0][rank])
        before = pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, s)
        a, la = fz.train_step(s, batches[1][rank], donate=False)
        b, lb = fz.train_step(s, batches[1][rank], donate=False)
        same_ab = all(pytree.tree_leaves(pytree.tree_map(_same, a, b)))
        unchanged = all(pytree.tree_leaves(pytree.tree_map(_same, s, before)))
        out["nodonate", stage] = (same_ab, unchanged, float(la) == float(lb), not torch.equal(
            fz.full_params(a)["wte.weight"], fz.full_params(s)["wte.weight"]))
    # reading a state on one rank only never starts a collective (it used to deadlock at stages 1-2)
    s = fz.init(make_model(), spec(2, 1))
    s, _ = fz.train_step(s, batches[0][rank])
    with _Count() as c:
        if rank == 0:
            str(fz.memory_report(s)), str(fz.comm_report(s)), repr(s), s.params, s.metrics["grad_norm"].item()
    out["one_rank"] = c.calls
    for stage in (0, 1, 2, 3):  # bf16: replace(params=) moves the masters the optimizer updates (it was undone)
        out["edit", stage] = _edited_params(stage, batches[0][rank])
    return out


_EDITED = "blocks.0.attn.qkv.weight"


def _edited_params(stage: int, batch) -> tuple[bool, bool, bool]:
    """A bf16 state's params with one tensor zeroed by replace(params=), then a step of lr 0: (that tensor
    is zero after it, the other params are as they were, the other masters are as they were, bit for bit)."""
    s = fz.init(make_model(), spec(stage, 1, precision="bf16", clip_grad_norm=None,
                                   optimizer=fz.optim.adamw(lr=0.0, weight_decay=0.0)))
    params, masters = fz.full_params(s), {k: v.full_tensor() for k, v in s.master.items()}
    s = s.replace(params={k: torch.zeros_like(v) if k == _EDITED else v for k, v in s.params.items()})
    new, _ = fz.train_step(s, batch)
    after, after_master = fz.full_params(new), {k: v.full_tensor() for k, v in new.master.items()}
    return (not after[_EDITED].any() and not after_master[_EDITED].any(),
            all(torch.equal(after[k], v) for k, v in params.items() if k != _EDITED),
            all(torch.equal(after_master[k], v) for k, v in masters.items() if k != _EDITED))


def _same(x, y) -> bool:
    if isinstance(x, DTensor):
        x, y = x._local_tensor, y._local_tensor
    if isinstance(x, torch.Tensor):
        return x.dtype == y.dtype and x.shape == y.shape and bool(torch.equal(x, y) or (x.isnan() == y.isnan()).all()
                                                                   and torch.equal(x.nan_to_num(), y.nan_to_num()))
    return x == y


@pytest.fixture(scope="module")
def world2():
    return run_ranks(2, _in_flight)


def test_reading_a_state_in_flight_never_starts_a_collective(world2):
    for res in world2:
        for stage in (1, 2):
            before, after_reads, clone_arriving, calls, back, mapped, n, shows, step = res["flight", stage]
            assert before > 0  # the all-gathers really were still in flight
            assert after_reads == before  # flatten, tree_map, repr, params by name: nothing waited
            assert calls == [], calls  # and no collective was started
            assert back == mapped == "State" and n == 26 and shows and step == ()
            assert clone_arriving == 0  # deepcopy's copy is whole
        assert res["one_rank"] == []


def test_every_read_of_a_state_in_flight_sees_whole_values(world2):
    for stage in (1, 2):
        clone, orig, _ = world2[0]["values", stage]
        for k in orig:
            assert torch.equal(clone[k], orig[k]), k
            assert torch.equal(orig[k], world2[1]["values", stage][1][k]), k  # the same on every rank


def test_donate_false_twice_gives_identical_states_and_keeps_the_original(world2):
    for res in world2:
        for stage in (1, 3):
            same_ab, unchanged, same_loss, moved = res["nodonate", stage]
            assert same_ab and unchanged and same_loss and moved, (stage, res["nodonate", stage])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_replaced_leaves_are_what_the_next_step_uses(precision):
    """Zero weights put in by replace(): the next step starts from them (it used to copy the
    hidden storage back), in every stage alike."""
    field = "params" if precision == "fp32" else "master"
    batch = rank_batches(1, 1, 1)[0][0]
    results = {}
    for stage in (0, 1, 2, 3):
        s = fz.init(make_model(), spec(stage, 1, precision=precision, clip_grad_norm=None))
        s = s.replace(**{field: pytree.tree_map(torch.zeros_like, getattr(s, field))})
        new, loss = fz.train_step(s, batch)
        weights = getattr(new, field)
        results[stage] = {k: v.full_tensor() for k, v in weights.items()}
        largest = max(float(v.abs().max()) for v in results[stage].values())
        if precision == "fp32":  # zero weights: uniform logits, and a zero gradient keeps them zero
            assert float(loss) == pytest.approx(math.log(64), rel=1e-6) and largest == 0.0
        else:  # bf16 params still hold the old weights: one AdamW step from a zero master moves it by <= lr
            assert LR / 2 < largest <= LR * (1 + 1e-3)
    for stage in (1, 2, 3):
        for k, v in results[0].items():
            assert torch.equal(results[stage][k], v), (stage, k)


@pytest.mark.parametrize("world", [1, 2])
def test_replaced_params_are_what_a_mixed_precision_run_trains_on(world, world2):
    """bf16: replace(params=) changed the compute copies only, and the next step rebuilt them from the
    untouched fp32 masters: the edit was undone. The masters now follow what it changes, and keep their
    bits elsewhere, in every stage."""
    results = world2 if world == 2 else [{("edit", stage): _edited_params(stage, rank_batches(1, 1, 1)[0][0])
                                          for stage in (0, 1, 2, 3)}]
    for res in results:
        for stage in (0, 1, 2, 3):
            assert res["edit", stage] == (True, True, True), (world, stage)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_replaced_params_keep_an_offloaded_states_tiers(tier, tmp_path):
    """replace(params=) packed the masters in device memory: an NVMe state's DiskTensors came back whole in
    RAM. They stay in their tier, and the edit trains."""
    off = fz.offload.cpu() if tier == "cpu" else fz.offload.nvme(str(tmp_path), buffer_mb=0.05)
    s = fz.init(make_model(), spec(3, 1, precision="bf16", clip_grad_norm=None, offload=off,
                                   optimizer=fz.optim.adamw(lr=0.0, weight_decay=0.0)))
    kinds = {type(f._local_tensor).__name__ for f in s.master_flats.values()}
    s = s.replace(params={k: torch.zeros_like(v) if k == _EDITED else v for k, v in s.params.items()})
    assert {type(f._local_tensor).__name__ for f in s.master_flats.values()} == kinds
    new, _ = fz.train_step(s, rank_batches(1, 1, 1)[0][0])
    assert not fz.full_params(new)[_EDITED].any()


def test_a_leaf_that_does_not_fit_is_a_clear_error():
    s = fz.init(make_model(), spec(3, 1, precision="bf16"))
    with pytest.raises(fz.ConfigError, match=r"master\['wte.weight'\] is torch.float64"):
        s.replace(master={k: v.double() for k, v in s.master.items()})
    r = fz.init(make_model(), spec(0, 1))  # replicated: slicing keeps the placement, changes the shape
    with pytest.raises(fz.ConfigError, match=r"params\['blocks.0.attn.qkv.weight'\] has shape"):
        r.replace(params={k: (v[:1] if k == "blocks.0.attn.qkv.weight" else v) for k, v in r.params.items()})
    with pytest.raises(fz.ConfigError, match=r"params\['wte.weight'\] has placements \(Replicate\(\),\)"):
        s.replace(params={k: v.redistribute(placements=[Replicate()]) for k, v in s.params.items()})
    with pytest.raises(fz.ConfigError, match="missing 'wpe.weight'"):
        s.replace(params={k: v for k, v in s.params.items() if k != "wpe.weight"})
    doubled = pytree.tree_map(lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x, s)
    with pytest.raises(fz.ConfigError, match=r"state.param_flats\[0\] \(the bucket of 'wte.weight'.*float64"):
        fz.train_step(doubled, rank_batches(1, 1, 1)[0][0])
    plain = dataclasses.replace(s, param_flats=tuple(f.to_local() for f in s.param_flats))
    with pytest.raises(fz.ConfigError, match=r"state.param_flats\[0\] .* is a Tensor; expected a DTensor"):
        fz.train_step(plain, rank_batches(1, 1, 1)[0][0])
    with pytest.raises(fz.ConfigError, match="fp32 state has no master"):
        fz.init(make_model(), spec(0, 1)).replace(master={"x": torch.zeros(1)})


def test_state_is_a_frozen_pytree():
    state = fz.init(make_model(), spec(3, 1))
    leaves, treedef = pytree.tree_flatten(state)
    assert sum(isinstance(x, DTensor) for x in leaves) >= 2 * len(state.params) + len(state.param_flats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.step = torch.tensor(5)
    doubled = pytree.tree_map(lambda x: x * 1.0 if isinstance(x, torch.Tensor) and x.is_floating_point() else x, state)
    assert isinstance(doubled, fz.State) and doubled is not state
    rebuilt = pytree.tree_unflatten(leaves, treedef)
    assert rebuilt.params.keys() == state.params.keys()
    new, loss = fz.train_step(doubled, rank_batches(1, 1, 1)[0][0])
    assert int(new.step) == 1 and torch.isfinite(loss)
    assert int(state.step) == 0  # the original was not donated: the step consumed `doubled`
    replaced = state.replace(data={"epoch": 3})
    assert replaced.data == {"epoch": 3} and state.data == {} and replaced.param_flats is state.param_flats
    assert "stage=3" in repr(state)
    with pytest.raises(TypeError, match=r"^an fz.State cannot be pickled .*: fz.save / fz.restore write and read it"):
        pickle.dumps(state)  # was "Can't pickle local object 'chain.<locals>.init'"
    assert copy.copy(state).param_flats is state.param_flats
    with pytest.raises(fz.ConfigError, match="donated"):
        fz.train_step(doubled, rank_batches(1, 1, 1)[0][0])
    with pytest.raises(fz.ConfigError, match="donated"):
        pytree.tree_leaves(doubled)
    assert repr(doubled) == "State(donated to fz.train_step)"
