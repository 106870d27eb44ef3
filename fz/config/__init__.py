"""fz.config: DeepSpeed JSON configs -> fz.Spec, with the provenance of every value."""
from fz.config.deepspeed import AUTO_NAMES, read_deepspeed
from fz.config.explain import Provenance, explain

__all__ = ["AUTO_NAMES", "Provenance", "explain", "read_deepspeed"]
