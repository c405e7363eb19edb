"""tessera.zero: ZeRO stages 1-3 with mixed precision, loss scaling, clipping, accumulation
and CPU offload, around any elementwise torch.optim optimizer.

``ZeroOptimizer(model, optimizer, stage=..., group=...)`` is the entry point; ``FlatLayout``
and ``bucketize`` are the pure shard arithmetic under it.
"""

from tessera.zero.clip import GradStats, clip_coefficient, global_grad_stats, shard_weights
from tessera.zero.flat import FlatLayout, bucketize
from tessera.zero.flat_param import FlatParam
from tessera.zero.optimizer import ZeroOptimizer
from tessera.zero.precision import DynamicLossScaler, Precision, compute_dtype
from tessera.zero.units import assign_params, default_units
from tessera.zero.validate import ZeroConfig

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScaler",
    "FlatLayout",
    "FlatParam",
    "GradStats",
    "Precision",
    "ZeroConfig",
    "ZeroOptimizer",
    "assign_params",
    "bucketize",
    "clip_coefficient",
    "compute_dtype",
    "default_units",
    "global_grad_stats",
    "shard_weights",
]
