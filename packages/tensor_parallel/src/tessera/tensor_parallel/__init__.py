"""tessera.tensor_parallel: Megatron-style 1D tensor parallelism with sequence parallelism,
2D (SUMMA / Optimus) over a q x q grid (``two_d``), 2.5D (Tesseract) over q x q x d
(``two_p5_d``) and 3D over a q x q x q cube (``three_d``) tensor parallelism, and context
parallelism over the ``cp`` axis: ring and Ulysses attention, zigzag layout (``context``).

Layers (column/row-parallel linear, vocab-parallel embedding and cross-entropy, parallel
attention and MLP) built from ``tessera.comm``'s differentiable collectives, dropout RNG
streams, and ``parallelize(model, plan=..., mesh=...)`` to convert an ordinary model by a
declarative plan (``GPT_PLAN`` for the reference GPT, ``GPT2_PLAN``, ``LLAMA_PLAN`` and
``PHI3_PLAN`` for HF GPT-2, Llama and Phi3) whose styles are typed objects in a registry
(``register_style`` adds one); attention heads split by ``heads`` (grouped-query attention:
KV heads split or replicated; fused q|k|v by its parts' heads).

Exports the public API only; the pieces the layers are built from (shard arithmetic in
``partition``, plan matching in ``plan``, the sequence-region ops in ``sequence``, the
weight initialisers in ``init``) are imported from their modules.
"""

from tessera.tensor_parallel.blocks import ParallelMLP, ParallelSelfAttention
from tessera.tensor_parallel.context import (
    ContextParallelAttention,
    SequenceProbe,
    context_parallel_loss,
    context_parallelize,
    probe_sequence_split,
    ring_attention,
    split_batch,
    sync_context_parallel_grads,
    ulysses_attention,
)
from tessera.tensor_parallel.coverage import Coverage, tp_gradient_problems
from tessera.tensor_parallel.embedding import VocabParallelEmbedding
from tessera.tensor_parallel.heads import FusedHeadShardSpec, HeadLayout, HeadShardSpec, head_layout
from tessera.tensor_parallel.init import seeded_embedding, seeded_linear
from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, set_overlap
from tessera.tensor_parallel.loss import vocab_parallel_cross_entropy
from tessera.tensor_parallel.parallelize import coverage, parallelize, shard_of, shard_specs
from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.plan import Assignment, Plan, PlanLike, ResolvedPlan, resolve, resolve_plan
from tessera.tensor_parallel.plans import GPT2_PLAN, GPT_PLAN, LLAMA_PLAN, PHI3_PLAN, parallel_gpt_loss
from tessera.tensor_parallel.rng import DropoutRNG, ParallelDropout, RNGRegion
from tessera.tensor_parallel.sequence import (
    is_sequence_parallel,
    mark_sequence_parallel,
    sequence_parallel_params,
    sync_sequence_parallel_grads,
)
from tessera.tensor_parallel.style import (
    ApplyContext,
    BaseStyle,
    RefinesInner,
    Role,
    TPStyle,
    register_style,
    registered_styles,
    style_named,
)
from tessera.tensor_parallel.styles import Style
from tessera.tensor_parallel.three_d import (
    GPT_3D_PLAN,
    GPT_3D_VOCAB_PLAN,
    Cube3D,
    CubeShardSpec,
    Embedding3D,
    LayerNorm3D,
    Linear3D,
    VocabEmbedding3D,
    cross_entropy_3d,
    loss_3d,
    parallelize_3d,
)
from tessera.tensor_parallel.two_d import (
    GPT_2D_PLAN,
    GPT_2D_VOCAB_PLAN,
    Embedding2D,
    Grid2D,
    GridShardSpec,
    LayerNorm2D,
    Linear2D,
    VocabEmbedding2D,
    batch_block,
    bind_2d,
    cross_entropy_2d,
    loss_2d,
    parallelize_2d,
)
from tessera.tensor_parallel.two_p5_d import (
    GPT_2P5D_PLAN,
    GPT_2P5D_VOCAB_PLAN,
    DepthShardSpec,
    Embedding2p5D,
    Grid2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    VocabEmbedding2p5D,
    batch_block_2p5d,
    bind_2p5d,
    cross_entropy_2p5d,
    loss_2p5d,
    parallelize_2p5d,
)

__version__ = "0.1.0"

__all__ = [
    "GPT2_PLAN",
    "GPT_2D_PLAN",
    "GPT_2D_VOCAB_PLAN",
    "GPT_2P5D_PLAN",
    "GPT_2P5D_VOCAB_PLAN",
    "GPT_3D_PLAN",
    "GPT_3D_VOCAB_PLAN",
    "GPT_PLAN",
    "LLAMA_PLAN",
    "PHI3_PLAN",
    "ApplyContext",
    "Assignment",
    "BaseStyle",
    "ColumnParallelLinear",
    "ContextParallelAttention",
    "Coverage",
    "Cube3D",
    "CubeShardSpec",
    "DepthShardSpec",
    "DropoutRNG",
    "Embedding2D",
    "Embedding2p5D",
    "Embedding3D",
    "FusedHeadShardSpec",
    "Grid2D",
    "Grid2p5D",
    "GridShardSpec",
    "HeadLayout",
    "HeadShardSpec",
    "LayerNorm2D",
    "LayerNorm2p5D",
    "LayerNorm3D",
    "Linear2D",
    "Linear2p5D",
    "Linear3D",
    "ParallelDropout",
    "ParallelMLP",
    "ParallelSelfAttention",
    "Plan",
    "PlanLike",
    "RNGRegion",
    "RefinesInner",
    "ResolvedPlan",
    "Role",
    "RowParallelLinear",
    "SequenceProbe",
    "ShardSpec",
    "Style",
    "TPStyle",
    "VocabEmbedding2D",
    "VocabEmbedding2p5D",
    "VocabEmbedding3D",
    "VocabParallelEmbedding",
    "batch_block",
    "batch_block_2p5d",
    "bind_2d",
    "bind_2p5d",
    "context_parallel_loss",
    "context_parallelize",
    "coverage",
    "cross_entropy_2d",
    "cross_entropy_2p5d",
    "cross_entropy_3d",
    "head_layout",
    "is_sequence_parallel",
    "loss_2d",
    "loss_2p5d",
    "loss_3d",
    "mark_sequence_parallel",
    "parallel_gpt_loss",
    "parallelize",
    "parallelize_2d",
    "parallelize_2p5d",
    "parallelize_3d",
    "probe_sequence_split",
    "register_style",
    "registered_styles",
    "resolve",
    "resolve_plan",
    "ring_attention",
    "seeded_embedding",
    "seeded_linear",
    "sequence_parallel_params",
    "set_overlap",
    "shard_of",
    "shard_specs",
    "split_batch",
    "style_named",
    "sync_context_parallel_grads",
    "sync_sequence_parallel_grads",
    "tp_gradient_problems",
    "ulysses_attention",
    "vocab_parallel_cross_entropy",
]
