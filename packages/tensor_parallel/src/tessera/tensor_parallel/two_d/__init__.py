"""2D tensor parallelism (SUMMA / Optimus, as Colossal-AI's 2D layers) over a q x q grid.

Activations are split on the batch over the grid's rows and on the hidden over its columns;
``Linear2D`` (SUMMA), ``LayerNorm2D``, ``Embedding2D`` (hidden-split), ``VocabEmbedding2D``
and the classifier loss ``cross_entropy_2d`` keep that layout. Importing this package
registers the styles ``2d_linear``, ``2d_classifier``, ``2d_layernorm``, ``2d_embedding``,
``2d_vocab_embedding`` and ``2d_attention``; ``GPT_2D_PLAN`` converts the reference GPT,
through ``parallelize_2d(model, mesh=mesh)`` or
``parallelize(model, plan=bind_2d(GPT_2D_PLAN, Grid2D.from_mesh(mesh)), mesh=mesh)``.
"""

from tessera.tensor_parallel.two_d.activations import activation_bytes_2d
from tessera.tensor_parallel.two_d.embedding import EMBEDDING_SPEC, Embedding2D
from tessera.tensor_parallel.two_d.grid import Grid2D, GridShardSpec, check_grid_divisible, grid_side
from tessera.tensor_parallel.two_d.layernorm import NORM_SPEC, LayerNorm2D, normalize_2d
from tessera.tensor_parallel.two_d.linear import BIAS_SPEC, WEIGHT_SPEC, Linear2D, summa_matmul
from tessera.tensor_parallel.two_d.loss import batch_block, cross_entropy_2d, loss_2d
from tessera.tensor_parallel.two_d.plans import GPT_2D_PLAN, GPT_2D_VOCAB_PLAN, bind_2d, parallelize_2d
from tessera.tensor_parallel.two_d.styles import (
    Attention2DStyle,
    Embedding2DStyle,
    LayerNorm2DStyle,
    Linear2DStyle,
    Style2D,
    Styles2D,
    VocabEmbedding2DStyle,
    register,
)
from tessera.tensor_parallel.two_d.vocab_embedding import VOCAB_EMBEDDING_SPEC, VocabEmbedding2D

__all__ = [
    "BIAS_SPEC",
    "EMBEDDING_SPEC",
    "GPT_2D_PLAN",
    "GPT_2D_VOCAB_PLAN",
    "NORM_SPEC",
    "VOCAB_EMBEDDING_SPEC",
    "WEIGHT_SPEC",
    "Attention2DStyle",
    "Embedding2D",
    "Embedding2DStyle",
    "Grid2D",
    "GridShardSpec",
    "LayerNorm2D",
    "LayerNorm2DStyle",
    "Linear2D",
    "Linear2DStyle",
    "Style2D",
    "Styles2D",
    "VocabEmbedding2D",
    "VocabEmbedding2DStyle",
    "activation_bytes_2d",
    "batch_block",
    "bind_2d",
    "check_grid_divisible",
    "cross_entropy_2d",
    "grid_side",
    "loss_2d",
    "normalize_2d",
    "parallelize_2d",
    "register",
    "summa_matmul",
]
