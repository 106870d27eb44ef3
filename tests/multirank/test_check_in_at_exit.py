"""A check-in that is a rank's last call does not fail its peers when rank 0 leaves.

Rank 0 hosts the store (env://). A collective API whose check-in has no collective after it
(fz.full_params at ZeRO-0 reads rank 0's own copy; so does trainer.save_model at 0-2) let rank
0 return, finish its script and take the store down while rank 1 was still polling it: rank 1
failed with "the job's store does not answer" at the end of a good run. Rank 1's polls are
slowed here so that it is always still polling when rank 0 arrives last.
"""
from __future__ import annotations

import time

import fz
from fz.distributed import arrival
from fz.testing.spawn import run_ranks

from support.helpers import make_model, spec


def _job(rank, world):
    state = fz.init(make_model(), spec(0, 1, timeout_s=30.0))
    if rank == 1:  # rank 1 checks in first and then polls slowly
        slow = time.sleep
        arrival.time = type("SlowTime", (), {"sleep": staticmethod(lambda s: slow(0.8)),  # type: ignore[attr-defined]
                                             "monotonic": staticmethod(time.monotonic)})
    else:
        time.sleep(1.0)
    params = fz.full_params(state)  # rank 0 arrives last and returns at once: its script ends here
    return sorted(params)


def test_rank_0_leaving_after_its_last_check_in_does_not_fail_a_peer_still_polling():
    names = run_ranks(2, _job, timeout=120)
    assert names[0] == names[1] and names[0], names


def _calls(rank, world):
    from fz.distributed import peers
    state = fz.init(make_model(), spec(3, 1, timeout_s=30.0))
    for _ in range(5):
        fz.full_params(state)
    prefix = f"fz/call/fz.full_params/0-{world}"
    store = peers.store_for(list(range(world)))
    fz.distributed.arrive("test/all_done", list(range(world)), rank)  # every rank is past its fifth call
    return {n: [store.check([f"{prefix}/{n}/{r}"]) for r in range(world)] for n in range(1, 6)}


def test_the_store_keeps_two_calls_check_in_keys_however_many_calls():
    held = run_ranks(2, _calls, timeout=120)[0]
    assert held == {1: [False, False], 2: [False, False], 3: [False, False], 4: [True, True], 5: [True, True]}
