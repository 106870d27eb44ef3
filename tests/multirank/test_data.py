"""fz.data.loader: the position lives in state.data, so fz.restore resumes at the exact next sample
(mid-epoch, with workers, at another world size) and a restored run's losses are bit-identical.

One world-2 spawn trains a tiny model from the loader, uninterrupted and with a save/restore
mid-epoch; this process (world 1) continues the world-2 checkpoint and runs the workers
(spawned ranks are daemons, which cannot start DataLoader workers).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.data import Dataset, IterableDataset

import fz
from fz.testing.spawn import run_ranks

N, MICRO, EPOCHS, SAVE_AT = 37, 3, 2, 4  # world 2: 6 samples a step, 6 steps an epoch, 1 sample dropped


class Numbers(Dataset):
    """Map-style: sample i is the tensor [i]."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([i])


class Stream(IterableDataset):
    """Iterable, in an order of its own."""

    def __iter__(self):
        return iter([torch.tensor([(7 * i) % N]) for i in range(N)])


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))


def _loss(model, batch):
    x = batch.float() / N
    return (model(x) - torch.sin(6 * x)).pow(2).mean()


def _spec(**kw):
    return fz.Spec(stage=kw.pop("stage", 3), optimizer=fz.optim.adamw(lr=1e-2), loss_fn=_loss, seed=0, **kw)


def _train(state, loader, steps):
    seen, losses = [], []
    for batch in loader:
        state, loss = fz.train_step(state, batch)
        seen.append(batch.flatten().tolist())
        losses.append(float(loss))
        if len(seen) == steps:
            break
    return state, seen, losses


def _run(dataset, ckpt, *, workers=0, micro=MICRO, split=True, spec_kw=None):
    """(ids per step, losses): 2 epochs, uninterrupted or saved and restored at SAVE_AT."""
    spec = _spec(**(spec_kw or {}))
    state = fz.init(_model(), spec)
    loader = fz.data.loader(dataset, state, micro_batch=micro, num_workers=workers, epochs=EPOCHS)
    total = loader.steps_per_epoch * EPOCHS if loader.steps_per_epoch else None
    if not split:
        _, seen, losses = _train(state, loader, total or 10**9)
        return seen, losses
    state, seen, losses = _train(state, loader, SAVE_AT)
    fz.save(loader.attach(state), ckpt)
    state = fz.restore(fz.init(_model(), spec), ckpt)
    loader = fz.data.loader(dataset, state, micro_batch=micro, num_workers=workers, epochs=EPOCHS)
    _, more, more_losses = _train(state, loader, 10**9)
    return seen + more, losses + more_losses


def _world2(rank, world, root):
    out = {}
    for name, ds in (("map", Numbers()), ("iter", Stream())):
        out[name, "whole"] = _run(ds, None, split=False)
        out[name, "split"] = _run(ds, f"{root}/{name}")
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return root, run_ranks(2, _world2, str(root), timeout=240)


def _global(ranks, key):
    """Each step's global batch: rank 0's rows, then rank 1's."""
    (ids0, _), (ids1, _) = ranks[0][key], ranks[1][key]
    return [a + b for a, b in zip(ids0, ids1)]


@pytest.mark.parametrize("name", ["map", "iter"])
def test_resume_mid_epoch_continues_the_exact_sequence_and_losses(world2, name):
    _, ranks = world2
    whole, split = _global(ranks, (name, "whole")), _global(ranks, (name, "split"))
    assert len(whole) == 2 * (N // 6) and split == whole
    for r in ranks:  # bit-identical losses after the restore, on every rank
        assert r[name, "split"][1] == r[name, "whole"][1]
    for epoch in (whole[:6], whole[6:]):  # every sample at most once an epoch; one of 37 dropped
        flat = [i for step in epoch for i in step]
        assert len(flat) == len(set(flat)) == 36
    if name == "map":
        assert [i for s in whole[:6] for i in s] != [i for s in whole[6:] for i in s]  # reshuffled each epoch
    else:
        assert [i for s in whole[:6] for i in s] == [(7 * i) % N for i in range(36)]  # the dataset's own order


@pytest.mark.parametrize("name", ["map", "iter"])
@pytest.mark.parametrize("workers", [0, 2])
def test_workers_resume_exactly(tmp_path, name, workers):
    ds = Numbers() if name == "map" else Stream()
    whole = _run(ds, None, workers=workers, micro=6, split=False)
    split = _run(ds, tmp_path / "ckpt", workers=workers, micro=6)
    assert split == whole and len(whole[0]) == 2 * (N // 6)


@pytest.mark.parametrize("micro", [6, 4])
def test_a_world2_checkpoint_resumes_at_world1_without_repeating_or_skipping(world2, micro):
    """Saved at world 2 after 4 steps of 6 samples; continued at world 1 with 2 workers, with the
    same global batch (6) and another one (4): the stream goes on at sample 24 of epoch 0."""
    root, ranks = world2
    state = fz.restore(fz.init(_model(), _spec()), f"{root}/map")
    loader = fz.data.loader(Numbers(), state, micro_batch=micro, num_workers=2, epochs=EPOCHS)
    _, more, losses = _train(state, loader, 10**9)
    whole = _global(ranks, ("map", "whole"))
    epoch0 = [i for s in whole[:6] for i in s]
    before = [i for s in whole[:SAVE_AT] for i in s]
    got0 = before + [i for s in more[:(36 - 24) // micro] for i in s]
    assert got0 == epoch0[:len(got0)] and len(got0) == 24 + (N - 24) // micro * micro
    order1 = fz.data.epoch_order(N, 1, 0, True).tolist()  # epoch 1 from its start, in the global order
    got1 = [i for s in more[(N - 24) // micro:] for i in s]
    assert got1 == order1[:len(got1)] and len(got1) == N // micro * micro
    if micro == 6:  # the same global batches as the world-2 run: the same losses (up to reduction order)
        assert losses == pytest.approx(ranks[0]["map", "whole"][1][SAVE_AT:], rel=1e-5)


def test_batches_are_this_ranks_rows_of_the_global_order():
    spec = _spec(stage=0, grad_accum=2)
    state = fz.init(_model(), spec)
    loader = fz.data.loader(Numbers(), state, micro_batch=2, shuffle=False)
    assert loader.steps_per_epoch == N // 4
    batches = [b for _, b in zip(range(loader.steps_per_epoch + 1), loader)]
    assert batches[0].shape == (4, 1) and batches[0].flatten().tolist() == [0, 1, 2, 3]
    assert batches[-1].flatten().tolist() == [0, 1, 2, 3] and loader.epoch == 1  # epoch 1 starts over
    assert loader.state_dict()["index"] == 4


def test_loader_errors_name_the_fix():
    state = fz.init(_model(), _spec())
    state = state.replace(step=torch.tensor(5))
    with pytest.raises(fz.ConfigError, match=r"at step 5 but state.data has no position 'loader'.*restart=True"):
        fz.data.loader(Numbers(), state, micro_batch=2)
    assert fz.data.loader(Numbers(), state, micro_batch=2, restart=True).epoch == 0
    moved = fz.data.loader(Numbers(), state, micro_batch=2, restart=True, seed=1)
    with pytest.raises(fz.ConfigError, match=r"saved position has seed=1, this loader 0"):
        fz.data.loader(Numbers(), moved.attach(state), micro_batch=2)
    with pytest.raises(fz.ConfigError, match=r"iterable dataset is read in its own order"):
        fz.data.loader(Stream(), _spec(), micro_batch=2, shuffle=True)
    with pytest.raises(fz.ConfigError, match=r"37 samples make no step of 40"):
        fz.data.loader(Numbers(), _spec(), micro_batch=40)
    with pytest.raises(fz.ConfigError, match=r"micro_batch=None"):
        fz.data.loader(Numbers(), _spec())
