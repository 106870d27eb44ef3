"""fz.data.loader(split=True): each step as micro-batches of their own, holding the samples that
accelerate's sharded loader gives transformers' Trainer on each rank (checked against accelerate
itself), an epoch's last step kept; and fz.hf's order is accelerate's SeedableRandomSampler's."""
from __future__ import annotations

import pytest
import torch

import fz
from fz.data import Layout

accelerate_data = pytest.importorskip("accelerate.data_loader")


def steps(n: int, world: int, rank: int, micro: int, accum: int, drop_last: bool | str = False) -> list:
    """Per step, this rank's micro-batches as sample indices (sequential order), from the loader."""
    spec = fz.Spec(grad_accum=accum, micro_batch=micro)
    lay = Layout(micro * accum, world, rank, drop_last, micro)
    from fz.data.steps import Steps
    it = Steps(list(range(n)), lay, lambda rows: rows, (0, 0), 1, spec.seed, False, False)
    return [list(batches) for _, batches in it]


def accelerate_steps(n: int, world: int, rank: int, micro: int, accum: int, drop_last: bool = False):
    """What accelerate's BatchSamplerShard (transformers' Trainer, even_batches) gives this rank, by step
    (one process: the batch sampler itself, which accelerate's prepare_data_loader does not shard)."""
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(n)), micro, drop_last)
    shard = accelerate_data.BatchSamplerShard(sampler, num_processes=world, process_index=rank)
    batches = list(shard if world > 1 else sampler)
    return [batches[i:i + accum] for i in range(0, len(batches), accum)]


@pytest.mark.parametrize("n,world,micro,accum", [(40, 2, 2, 4), (37, 2, 3, 2), (64, 4, 1, 3), (23, 1, 4, 2)])
def test_micro_batches_are_accelerates_on_every_rank(n, world, micro, accum):
    for drop_last in (False, True):
        for rank in range(world):
            ours = steps(n, world, rank, micro, accum, "micro_batch" if drop_last else False)
            assert ours == accelerate_steps(n, world, rank, micro, accum, drop_last)  # the last smaller step too


def test_a_last_partial_micro_batch_is_filled_from_the_epochs_start():
    lay = Layout(2 * 2, 4, 0, False, 2)  # 4 ranks x 2 rows x 2 micro-batches: 16 a step
    assert lay.take(11) == 11 and lay.filled(11) == 16 and lay.take(3) == 3 and lay.filled(3) == 8
    assert Layout(4, 4, 0, "micro_batch", 2).take(13) == 8 and Layout(4, 4, 0, True, 2).take(13) == 0
    assert Layout(4, 4, 0, False, 2).steps_in(33) == 3 and Layout(4, 4, 0, "micro_batch", 2).steps_in(33) == 2
    assert steps(3, 4, 3, 1, 1) == [[[0]]] and steps(3, 4, 2, 1, 1) == [[[2]]]


def test_loader_split_yields_micro_batches_collated_apart():
    spec = fz.Spec(grad_accum=2, micro_batch=2)
    data = [torch.tensor([i] * (1 + i % 3)) for i in range(9)]  # lengths 1..3: padded per micro-batch

    def pad(rows):
        width = max(len(r) for r in rows)
        return torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=-1) for r in rows])
    loader = fz.data.loader(data, spec, shuffle=False, collate_fn=pad, drop_last=False, split=True, epochs=1)
    got = list(loader)
    assert all(isinstance(s, fz.MicroBatches) for s in got)
    assert [len(s) for s in got] == [2, 2, 1]  # 9 samples: two steps of 4, then one micro-batch
    assert [tuple(b.shape) for b in got[0]] == [(2, 2), (2, 3)]  # each micro-batch padded to its own longest
    assert got[2][0].tolist() == [[8, 8, 8]]  # one process: short, as transformers' (more fill from the start)


def test_transformers_order_is_accelerates_seedable_random_sampler():
    from fz.hf.data import TorchOrder
    sampler = accelerate_data.SeedableRandomSampler(range(50), data_seed=7)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        assert list(sampler) == TorchOrder(7)(epoch, 50).tolist()
