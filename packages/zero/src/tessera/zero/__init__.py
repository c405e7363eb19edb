"""tessera.zero: plain data parallelism (stage 0) and ZeRO stages 1-3 with mixed precision,
loss scaling, clipping, accumulation, CPU offload and a chunk memory manager (device, host
and disk under budgets: ``memory=ChunkConfig(...)``), around any elementwise torch.optim
optimizer.

``ZeroOptimizer(model, optimizer, stage=..., group=...)`` is the entry point. The shard
arithmetic under it (``tessera.zero.flat``), the flat buffers (``tessera.zero.flat_param``)
and stage 3's unit ownership (``tessera.zero.units``) are importable from their modules.
"""

from tessera.zero.chunks import ChunkConfig
from tessera.zero.clip import clip_coefficient
from tessera.zero.optimizer import ZeroOptimizer
from tessera.zero.precision import DynamicLossScaler, Precision
from tessera.zero.units import default_units

__version__ = "0.1.0"

__all__ = [
    "ChunkConfig",
    "DynamicLossScaler",
    "Precision",
    "ZeroOptimizer",
    "clip_coefficient",
    "default_units",
]
