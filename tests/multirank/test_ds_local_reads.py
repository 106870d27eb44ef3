"""fz.deepspeed: at ZeRO 0-2 the script's `model.parameters()` and `model.state_dict()` read on one
rank only are local (DeepSpeed's `if rank == 0: torch.save(model.state_dict())`): no collective
starts, and they hold the weights the engine computes with (bf16 values, as DeepSpeed's module
holds them), not the first copy. A collective read alone (`safe_get_full_fp32_param`) fails in seconds,
naming it, where it hung until the timeout and ended the job; so does `engine.save_checkpoint()` alone while
the other rank waits in `deepspeed.comm.barrier()` (fz's, marked as a wait)."""
from __future__ import annotations

import torch

from fz.testing.spawn import run_ranks

from support.ds_local_jobs import Net, one_rank_reads


def test_a_read_on_one_rank_is_local_and_current(tmp_path):
    first = dict(Net().named_parameters())
    out = run_ranks(2, one_rank_reads, str(tmp_path), timeout=120)
    read, compute = out[0]["read"], out[0]["compute"]
    assert read and out[1]["read"] == {}
    assert "deepspeed.utils.safe_get_full_fp32_param: every rank must call" in out[0]["lone"], out[0]["lone"]
    assert "every rank must call" in out[0]["saved"] and "deepspeed.comm.barrier" in out[0]["saved"], out[0]["saved"]
    for name, want in compute.items():
        assert torch.equal(read[name], want) and torch.equal(read[f"sd.{name}"], want)
        assert not torch.equal(want, first[name].detach().to(torch.bfloat16).float())
