"""The chunk memory manager: ZeRO shards' masters, gradients and optimizer state in chunks
placed on the device, the host and the disk under budgets (``ZeroOptimizer(memory=...)``).

``ChunkConfig`` says where and how much; ``ChunkStore`` holds and moves the chunks;
``tessera.zero.chunks.policy`` places them (pure); ``tessera.zero.chunks.tiers`` is the
disk tier; ``tessera.zero.chunks.step`` steps the optimizer chunk by chunk.
"""

from typing import TYPE_CHECKING

from tessera.comm import lazy_exports
from tessera.zero.chunks.config import ChunkConfig, chunk_problems

if TYPE_CHECKING:
    from tessera.zero.chunks.chunk import Chunk, ChunkState, Tier, plan_chunks
    from tessera.zero.chunks.flat import ChunkedFlatParam
    from tessera.zero.chunks.store import ChunkStore
    from tessera.zero.chunks.tiers import ChunkFileError

if not TYPE_CHECKING:  # the modules that need torch, loaded on first use of one of their names
    __getattr__, __dir__ = lazy_exports(__name__, ("chunk", "flat", "store", "tiers"))

__all__ = [
    "Chunk",
    "ChunkConfig",
    "ChunkFileError",
    "ChunkState",
    "ChunkStore",
    "ChunkedFlatParam",
    "Tier",
    "chunk_problems",
    "plan_chunks",
]
