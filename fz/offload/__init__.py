"""fz.offload: where optimizer state and parameters live (device, host memory, disk), as
policies that are functions from state to state.

    spec = fz.Spec(stage=3, offload=fz.offload.nvme("/local_nvme", params=True))
    state = fz.offload.cpu()(state)      # move a live state's optimizer to host memory
    state = fz.offload.none()(state)     # and back
"""
from fz.offload.policy import TIERS, Offload, cpu, none, nvme
from fz.storage.disk import DiskTensor

__all__ = ["DiskTensor", "Offload", "TIERS", "cpu", "none", "nvme"]
