"""fz.optim: optax-style gradient transformations that run on local shards."""
from fz.optim import schedules
from fz.optim.adafactor import adafactor
from fz.optim.aliases import adam, adamw, sgd
from fz.optim.base import (
    GradientTransformation,
    apply_updates,
    chain,
    global_norm,
    masked,
    owned,
    sum_across_shards,
)
from fz.optim.lamb import lamb, scale_by_lamb
from fz.optim.lion import lion, scale_by_lion
from fz.optim.schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    constant,
    cosine,
    linear,
    warmup_linear,
)
from fz.optim.transforms import (
    add_decayed_weights,
    clip_by_global_norm,
    current_lr,
    restart_schedule,
    scale_by_adam,
    scale_by_learning_rate,
    scale_to_max_norm,
    trace,
)

__all__ = [
    "GradientTransformation", "chain", "apply_updates", "global_norm", "masked", "owned", "sum_across_shards",
    "adam", "adamw", "sgd", "lion", "lamb", "adafactor",
    "add_decayed_weights", "clip_by_global_norm", "scale_by_adam", "scale_by_lamb", "scale_by_lion",
    "scale_by_learning_rate", "scale_to_max_norm", "trace", "current_lr", "restart_schedule",
    "schedules", "constant", "linear", "cosine", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
    "LRRangeTest", "warmup_linear",
]
