"""fz.distributed: the multi-process runtime below sharding and the step.

- `group`: starting torch.distributed (from torchrun's environment, or one process of fz's own);
- `peers`: every blocking wait has a deadline, and a lost rank is a PeerError;
- `arrival`: ranks reaching the same call, checked with a deadline (`arrive`: a shell's own
  collective call, e.g. fz.hf.Trainer's save_model, fails fast when one rank makes it alone).

    fz.distributed.init()      # what fz.init does when no process group is running
"""
from fz.distributed.arrival import arrive
from fz.distributed.group import device_type, implicit, init

__all__ = ["arrive", "device_type", "implicit", "init"]
