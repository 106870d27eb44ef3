"""Store calls have a deadline; a PeerError quotes the limit that fired (issue 27, items 2 and 5)."""
from __future__ import annotations

import threading
import time

import pytest

from fz.distributed import peers, storecall
from fz.distributed.storecall import StoreDown, call

from support.timing import slowdown


def test_a_call_that_does_not_return_is_a_store_down_within_its_deadline():
    never = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(StoreDown, match=r"^the job's store did not answer within 0\.2 s$") as e:
        call(never.wait, 0.2)
    assert e.value.timed_out
    assert time.monotonic() - t0 < slowdown() * 2.0  # a quiet machine's bound, scaled


def test_a_failing_call_is_a_store_down_naming_the_error():
    def fails():
        raise RuntimeError("Connection reset by peer")

    with pytest.raises(StoreDown, match=r"the job's store failed \(RuntimeError: Connection reset by peer\)") as e:
        call(fails)
    assert not e.value.timed_out
    assert call(lambda: 7) == 7


def test_the_store_host_is_rank_0_unless_torchruns_agent_hosts_it(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert storecall.store_host() == ("rank 0", (0,))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert storecall.store_host() == ("the launcher (torchrun's agent)", ())


def test_the_limit_that_fired_is_gloos_when_it_says_it():
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation")
    assert peers._limit(gloo) == 20.0
    assert "no answer within 20 s" in peers._cause(gloo)
    assert peers._limit(RuntimeError("Connection reset by peer")) == peers.timeout_s()
