"""`deepspeed.ops` on fz: the optimizer classes DeepSpeed scripts construct (`deepspeed.ops.adam`)."""
from fz.deepspeed.ops import adam

__all__ = ["adam"]
