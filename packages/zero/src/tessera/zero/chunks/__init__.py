"""The chunk memory manager: ZeRO shards' masters, gradients and optimizer state in chunks
placed on the device, the host and the disk under budgets (``ZeroOptimizer(memory=...)``).

``ChunkConfig`` says where and how much; ``ChunkStore`` holds and moves the chunks;
``tessera.zero.chunks.policy`` places them (pure); ``tessera.zero.chunks.tiers`` is the
disk tier; ``tessera.zero.chunks.step`` steps the optimizer chunk by chunk.
"""

from tessera.zero.chunks.chunk import Chunk, ChunkState, Tier, plan_chunks
from tessera.zero.chunks.config import ChunkConfig
from tessera.zero.chunks.flat import ChunkedFlatParam
from tessera.zero.chunks.store import ChunkStore
from tessera.zero.chunks.tiers import ChunkFileError

__all__ = [
    "Chunk",
    "ChunkConfig",
    "ChunkFileError",
    "ChunkState",
    "ChunkStore",
    "ChunkedFlatParam",
    "Tier",
    "plan_chunks",
]
