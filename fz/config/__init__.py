"""fz.config: DeepSpeed JSON configs -> fz.Spec, with the provenance of every value."""
from fz.config.deepspeed import read_deepspeed
from fz.config.explain import Provenance, explain
from fz.config.keywords import AUTO_NAMES, TRAINER
from fz.config.warn import DeepSpeedConfigWarning

__all__ = ["AUTO_NAMES", "DeepSpeedConfigWarning", "Provenance", "TRAINER", "explain", "read_deepspeed"]
