"""fz/compat.py on the torch this runs on (CI runs it on 2.11, 2.13 and 2.15): each shim does
what fz relies on. The collectives are exercised at world 2 by test_comm.py."""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.utils.checkpoint import checkpoint

from fz.compat import FileSystemWriter
from fz.step.binding import checkpoint_seen


def test_dcp_save_returns_where_every_chunk_went(tmp_path):
    tensors = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4)}
    md = dcp.save(tensors, storage_writer=FileSystemWriter(tmp_path, sync_files=True), no_dist=True)
    where = {(i.fqn, tuple(i.offset)): info for i, info in (md.storage_data or {}).items()}
    for key, m in md.state_dict_metadata.items():
        for c in m.chunks:
            info = where[(key, tuple(c.offsets))]
            assert (tmp_path / info.relative_path).stat().st_size >= info.offset + info.length > info.offset


def test_a_checkpoint_started_inside_a_block_is_seen_both_ways():
    x = torch.ones(3, requires_grad=True)
    for reentrant in (False, True):
        with checkpoint_seen() as seen:
            y = checkpoint(torch.sin, x, use_reentrant=reentrant)
        assert seen == [True], reentrant
        y.sum().backward()  # the recompute runs (outside the context) and gives the true gradient
        torch.testing.assert_close(x.grad, torch.cos(x.detach()))
        x.grad = None
    with checkpoint_seen() as seen:
        torch.sin(x)
    assert seen == [False]
