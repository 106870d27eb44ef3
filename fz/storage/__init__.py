"""fz.storage: tensors backed by files (`DiskTensor`), their store and I/O pool.

The bottom layer of fz: it depends on nothing above it (errors only). The disk tier of
offload (fz/offload/) and stage 3's gather of disk-resident shards build on it.
"""
from fz.storage.disk import DiskTensor

__all__ = ["DiskTensor"]
