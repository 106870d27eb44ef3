"""What the other ranks' heartbeats say, read while waiting for them outside a collective.

Each rank's heartbeat (fz/distributed/peers.py) adds to its counter in the job's store and
publishes what it is doing. A wait that no collective bounds (the check-in of a call every
rank must make, fz/distributed/arrival.py; group start-up, fz/distributed/startup.py) reads
them here: a counter that stops moving is a lost rank, a published activity says what a rank
is doing and how long it has been waiting. Every store call has a deadline
(fz/distributed/storecall.py).
"""
from __future__ import annotations

import re
import time
from collections.abc import Iterable

from fz.distributed import peers
from fz.distributed.storecall import call


def published(ranks: Iterable[int]) -> dict[int, str]:
    """What each of `ranks` last said it was doing (ranks that said nothing are left out)."""
    store = peers.heartbeat_store()
    if store is None:
        return {}
    return call(lambda: {r: store.get(f"fz/doing/{r}").decode() for r in ranks if store.check([f"fz/doing/{r}"])})


def stopped(ranks: Iterable[int], seen: dict[int, tuple[int, float]]) -> list[int]:
    """The `ranks` whose heartbeat counter has not moved for PROBE seconds, by calls made while
    waiting for them (`seen`: each one's last counter and since when; StoreDown if the store does
    not answer). A rank that never beat counts from the first call."""
    store = peers.heartbeat_store()
    if store is None:
        return []
    now, lost = time.monotonic(), []
    counts = call(lambda: {q: store.add(f"fz/hb/{q}", 0) for q in ranks})
    for r, count in counts.items():
        last = seen.get(r)
        if last is None or last[0] != count:
            seen[r] = (count, now)
        elif now - last[1] >= peers.PROBE:
            lost.append(r)
    return lost


def stuck_for(doing_text: str) -> float:
    """Seconds a published activity says its rank has been waiting for the others (0: not waiting)."""
    m = re.search(r"\(waiting for other ranks for (\d+) s\)$", doing_text)
    return float(m.group(1)) if m else 0.0
