"""Host buffers a step keeps beside the ZeRO formula's terms, for fz.estimate: the buffer pool's
idle buffers (fz/storage/scratch.py) and the buffer a CPU shard group's collectives share
(fz/distributed/shm.py). Both are bounded by their owners; these are the bounds."""
from __future__ import annotations

from collections.abc import Sequence

from fz.offload.policy import Offload
from fz.precision import PRECISIONS
from fz.sharding.buckets import Bucket
from fz.sharding.comm import link_bytes
from fz.spec import Spec
from fz.storage.scratch import IDLE_CAP

__all__ = ["link_bytes", "pool_idle"]


def pool_idle(spec: Spec, buckets: Sequence[Bucket], el: int, policy: Offload) -> tuple[int, int]:
    """(host, one memory): the idle buffers the disk tier's pool keeps, at most IDLE_CAP times the
    largest (fz/storage/scratch.py): shards read from disk; on a CPU also packed gradients and
    gathered parameters. A buffer in use may be up to FIT times what it serves: not counted."""
    reads = max((b.shard_numel * el for b in buckets if b.sharded_param), default=0) if policy.params == "disk" else 0
    width = max(el, PRECISIONS[spec.reduce_dtype or "fp32"].itemsize)
    step = max((b.padded_numel * width for b in buckets if b.trainable), default=0)
    return IDLE_CAP * reads, IDLE_CAP * max(reads, step)
