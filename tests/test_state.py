"""State is a frozen pytree value: flatten, map, rebuild, replace."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

import fz
from helpers import make_model, rank_batches, spec


def test_state_is_a_frozen_pytree():
    state = fz.init(make_model(), spec(3, 1))
    leaves, treedef = pytree.tree_flatten(state)
    assert any(isinstance(x, DTensor) for x in leaves)
    assert sum(isinstance(x, DTensor) for x in leaves) >= 3 * len(state.params)  # params + two moments each
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.step = torch.tensor(5)
    # tree_map gives a new State; fz repacks tensors that no longer view its buckets
    doubled = pytree.tree_map(lambda x: x * 1.0 if isinstance(x, torch.Tensor) and x.is_floating_point() else x, state)
    assert isinstance(doubled, fz.State) and doubled is not state
    rebuilt = pytree.tree_unflatten(leaves, treedef)
    assert rebuilt.params.keys() == state.params.keys()
    new, loss = fz.train_step(doubled, rank_batches(1, 1, 1)[0][0])
    assert int(new.step) == 1 and torch.isfinite(loss)
    assert int(state.step) == 0  # the original was not donated: the step consumed `doubled`
    replaced = state.replace(data={"epoch": 3})
    assert replaced.data == {"epoch": 3} and state.data == {} and replaced.params is state.params
    assert "stage=3" in repr(state)
