"""Context (sequence) parallelism over the ``cp`` axis: ring and Ulysses attention.

``layout`` (which positions a rank holds: contiguous or zigzag; ``sequence_chunks``, how
many equal chunks a sequence is cut into), ``ring`` and ``ulysses`` (the attention cores),
``parallelize`` (``context_parallelize``: swap a model's named
attention cores; ``route_attention``: route its SDPA calls, found without names, through
``intercept``), ``positions`` (positions modules follow the sequence shards), ``probe``
(``probe_sequence_split``: the split model computes what the whole one does, checked before
training) and ``training`` (batch slices, the exact global loss, gradient sums over ``cp``).
"""

from tessera.tensor_parallel.context.layout import (
    Layout,
    chunks_of,
    local_positions,
    rank_positions,
    sequence_chunks,
    split_sequence,
    unsplit_sequence,
)
from tessera.tensor_parallel.context.parallelize import (
    ContextParallelAttention,
    Mode,
    context_parallelize,
    route_attention,
)
from tessera.tensor_parallel.context.positions import find_positions, follow_positions
from tessera.tensor_parallel.context.probe import SequenceProbe, probe_sequence_split
from tessera.tensor_parallel.context.ring import ring_attention
from tessera.tensor_parallel.context.training import (
    context_parallel_loss,
    split_batch,
    sync_context_parallel_grads,
)
from tessera.tensor_parallel.context.ulysses import check_ulysses, ulysses_attention

__all__ = [
    "ContextParallelAttention",
    "Layout",
    "Mode",
    "SequenceProbe",
    "check_ulysses",
    "chunks_of",
    "context_parallel_loss",
    "context_parallelize",
    "find_positions",
    "follow_positions",
    "local_positions",
    "probe_sequence_split",
    "rank_positions",
    "ring_attention",
    "route_attention",
    "sequence_chunks",
    "split_batch",
    "split_sequence",
    "sync_context_parallel_grads",
    "ulysses_attention",
    "unsplit_sequence",
]
