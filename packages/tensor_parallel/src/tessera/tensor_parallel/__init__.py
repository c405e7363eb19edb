"""tessera.tensor_parallel: Megatron-style 1D tensor parallelism with sequence parallelism.

Layers (column/row-parallel linear, vocab-parallel embedding and cross-entropy, parallel
attention and MLP) built from ``tessera.comm``'s differentiable collectives, dropout RNG
streams, and ``parallelize(model, plan=..., mesh=...)`` to convert an ordinary model by a
declarative plan (``GPT_PLAN`` for the reference GPT, ``GPT2_PLAN`` for HF GPT-2).
"""

from tessera.tensor_parallel.blocks import ParallelMLP, ParallelSelfAttention
from tessera.tensor_parallel.embedding import VocabParallelEmbedding
from tessera.tensor_parallel.init import embedding_weight, linear_weights, seeded_embedding, seeded_linear
from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from tessera.tensor_parallel.loss import vocab_parallel_cross_entropy
from tessera.tensor_parallel.parallelize import parallelize, shard_of
from tessera.tensor_parallel.partition import check_divisible, fused_shard_indices, shard_range
from tessera.tensor_parallel.plan import Assignment, Plan, PlanLike, Style, match_pattern, resolve_plan
from tessera.tensor_parallel.plans import GPT2_PLAN, GPT_PLAN, parallel_gpt_loss
from tessera.tensor_parallel.rng import DropoutRNG, ParallelDropout, RNGRegion
from tessera.tensor_parallel.sequence import (
    enter_tp_region,
    exit_tp_region,
    is_sequence_parallel,
    mark_sequence_parallel,
    scatter_to_sequence,
    sequence_parallel_params,
    sync_sequence_parallel_grads,
)

__version__ = "0.1.0"

__all__ = [
    "GPT2_PLAN",
    "GPT_PLAN",
    "Assignment",
    "ColumnParallelLinear",
    "DropoutRNG",
    "ParallelDropout",
    "ParallelMLP",
    "ParallelSelfAttention",
    "Plan",
    "PlanLike",
    "RNGRegion",
    "RowParallelLinear",
    "Style",
    "VocabParallelEmbedding",
    "check_divisible",
    "embedding_weight",
    "enter_tp_region",
    "exit_tp_region",
    "fused_shard_indices",
    "is_sequence_parallel",
    "linear_weights",
    "mark_sequence_parallel",
    "match_pattern",
    "parallel_gpt_loss",
    "parallelize",
    "resolve_plan",
    "scatter_to_sequence",
    "seeded_embedding",
    "seeded_linear",
    "sequence_parallel_params",
    "shard_of",
    "shard_range",
    "sync_sequence_parallel_grads",
    "vocab_parallel_cross_entropy",
]
