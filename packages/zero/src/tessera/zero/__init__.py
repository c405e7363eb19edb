"""tessera.zero: plain data parallelism (stage 0) and ZeRO stages 1-3 with mixed precision,
loss scaling, clipping, accumulation, CPU offload and a chunk memory manager (device, host
and disk under budgets: ``memory=ChunkConfig(...)``), around any elementwise torch.optim
optimizer.

``ZeroOptimizer(model, optimizer, stage=..., group=...)`` is the entry point. The shard
arithmetic under it (``tessera.zero.flat``), the flat buffers (``tessera.zero.flat_param``)
and stage 3's unit ownership (``tessera.zero.units``) are importable from their modules.
"""

from typing import TYPE_CHECKING

from tessera.comm import lazy_exports
from tessera.zero.chunks.config import ChunkConfig, chunk_problems
from tessera.zero.precisions import Precision

if TYPE_CHECKING:
    from tessera.zero.clip import clip_coefficient
    from tessera.zero.optimizer import ZeroOptimizer
    from tessera.zero.precision import DynamicLossScaler
    from tessera.zero.units import default_units

# the submodules that need torch (importing the package does not: a launcher checks
# ``chunk_problems`` before torch is loaded); the names of __all__ not imported above
_LAZY = ("clip", "optimizer", "precision", "units")

if not TYPE_CHECKING:  # hidden from mypy, which then checks every name as imported above
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__version__ = "0.1.0"

__all__ = [
    "ChunkConfig",
    "DynamicLossScaler",
    "Precision",
    "ZeroOptimizer",
    "chunk_problems",
    "clip_coefficient",
    "default_units",
]
