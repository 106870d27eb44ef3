"""The non-finite check folded into the clip's norm (fz/step/update.py: GradNorms): with clipping on,
one pass over the gradients gives both the global norm and the check's finding, and each equals
what its own pass gave (the norm bit for bit, the finding index for index)."""
from __future__ import annotations

import pytest
import torch

from fz.step.nonfinite import first_nonfinite
from fz.step.update import GradNorms, _row_blocks


def _grads(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (7, 5), "b": (13,), "c": (), "d": (4, 3, 2), "e": (1, 9)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _separate_norm_sq(tree, sharded, world):
    """The norm's sum of squares as fz computed it in a pass of its own (before the fold)."""
    parts = []
    for want in (False, True):
        ts = [t for k, t in tree.items() if (k in sharded) == want]
        if not want:
            ts = [piece for t in ts for piece in _row_blocks(t, world)]
        norms = torch._foreach_norm(ts, 2) if ts else [torch.zeros(())]
        parts.append(torch.stack(norms).double().square().sum())
    return parts


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("sharded", [set(), {"a", "d"}, {"a", "b", "c", "d", "e"}])
def test_the_norm_is_its_own_pass_bit_for_bit(world, sharded):
    grads = _grads()
    got = GradNorms(grads, sharded, world).local_parts()
    want = _separate_norm_sq(grads, sharded, world)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("bad", [None, ("a", (3, 1), float("nan")), ("c", (), float("inf")),
                                 ("d", (3, 2, 1), float("-inf")), ("e", (0, 8), float("nan"))])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_finding_is_the_sum_checks(bad, world):
    grads = _grads(1)
    if bad is not None:
        name, at, value = bad
        grads[name][at] = value
        grads["b"][12] = float("nan") if name in ("d", "e") else grads["b"][12]  # a later one too
    got = GradNorms(grads, {"d"}, world).first_nonfinite()
    assert int(got) == int(first_nonfinite(grads))
    assert int(got) == (0 if bad is None else min(list(grads).index(bad[0]),
                                                  list(grads).index("b") if bad[0] in ("d", "e") else 99) + 1)


def test_a_gradient_too_large_for_an_fp32_norm_counts_as_non_finite():
    """Its norm overflows, so clipping could not scale it: the step skips (or raises) instead."""
    grads = {"a": torch.full((4,), 3e19), "b": torch.ones(2)}
    assert int(GradNorms(grads, set(), 1).first_nonfinite()) == 1


def test_host_norms_on_several_threads_are_foreach_norms_bits():
    """Large host tensors' norms run side by side on threads (fz/optim/norms.py): each is still one
    vector_norm of the whole tensor, so the values are torch._foreach_norm's, bit for bit, in order."""
    from fz.optim.norms import PARALLEL_MIN, norms
    g = torch.Generator().manual_seed(0)
    sizes = [(3 * PARALLEL_MIN + 5, 1.0), (7, 2.0), (PARALLEL_MIN, 1e-3), (2 * PARALLEL_MIN, 1e3), (0, 1.0)]
    tensors = [torch.randn(n, generator=g) * s for n, s in sizes]
    tensors.append(torch.randn(4 * PARALLEL_MIN, generator=g)[::2])  # a strided view
    tensors.append(torch.full((PARALLEL_MIN,), float("inf")))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            got = norms(tensors)
            want = torch._foreach_norm(tensors, 2)
            assert len(got) == len(want)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), n
    finally:
        torch.set_num_threads(threads)
    assert norms([]) == []
