"""One gradient per gathered bucket and micro-batch: the sum over every gather of it.

At stage 3 each use of a bucket has a gather of its own: a parameter the embedding and the
LM head share is gathered once a forward and each gets views of it (fz/sharding/gather.py),
a block called twice is gathered twice.
Each gather's backward gives the bucket's gradient from that use. Reduce-scattering each
and adding the shards would add the ranks' terms in another order than the one tensor
used twice that autograd sums (and than stages 0-2 do), so the runner counts a bucket's
gathers in forward and passes the gradient on when the last use's backward has given its
part: the parts added in the order they came, as autograd adds them, bit for bit. Until
then the parts' sum is held (one bucket-sized gradient, in the compute dtype). A use whose
backward never comes (its output did not reach the loss) is flushed when backward is done.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from fz.sharding.buckets import Bucket

Sink = Callable[[Bucket, Sequence[Tensor]], None]


class GradUses:
    """Counts gathers of each bucket and sends `sink(bucket, grads)` once their backwards are in."""

    def __init__(self, sink: Sink):
        self.sink = sink
        self.left: dict[int, int] = {}  # bucket index -> gathers whose backward is still to come
        self.parts: dict[int, tuple[Bucket, tuple[Tensor, ...]]] = {}  # the sum of the parts so far

    def gathered(self, b: Bucket) -> None:
        """A gather of `b` whose backward will give a part (grad enabled, trainable, in forward)."""
        self.left[b.index] = self.left.get(b.index, 0) + 1

    def __call__(self, b: Bucket, grads: Sequence[Tensor]) -> None:
        held = self.parts.pop(b.index, None)
        if held is not None:
            grads = tuple(h + g for h, g in zip(held[1], grads))
        left = self.left.get(b.index, 1) - 1
        if left > 0:
            self.left[b.index] = left
            self.parts[b.index] = (b, tuple(grads))
            return
        self.left.pop(b.index, None)
        self.sink(b, grads)

    def flush(self) -> None:
        """Backward is done: send what uses without a backward left waiting."""
        parts, self.parts, self.left = self.parts, {}, {}
        for b, grads in parts.values():
            self.sink(b, grads)
