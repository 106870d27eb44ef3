"""fz.optim: optax-style gradient transformations that run on local shards."""
from fz.optim.aliases import adam, adamw, sgd
from fz.optim.base import (
    GradientTransformation,
    apply_updates,
    chain,
    global_norm,
    norm_reduction,
    shard_reduction,
    sum_across_shards,
)
from fz.optim.transforms import (
    add_decayed_weights,
    clip_by_global_norm,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)

__all__ = [
    "GradientTransformation", "chain", "apply_updates", "global_norm", "norm_reduction", "shard_reduction",
    "sum_across_shards",
    "adam", "adamw", "sgd", "add_decayed_weights", "clip_by_global_norm", "scale_by_adam",
    "scale_by_learning_rate", "trace",
]
