"""2.5D tensor parallelism (Tesseract, as Colossal-AI's 2.5D layers) over a q x q x d grid.

The 2D SUMMA layers (``two_d``) run inside each of d depth layers; the depth splits the
batch further (rank (k, i, j) holds batch block ``k*q + i`` of q*d and hidden block j) and
replicates the weights, whose gradients are all-reduced over ``tp_dep``. ``Linear2p5D``,
``LayerNorm2p5D``, ``Embedding2p5D`` (hidden-split), ``VocabEmbedding2p5D`` and the loss
``cross_entropy_2p5d`` keep that layout. Importing this package registers the styles
``2.5d_linear``, ``2.5d_classifier``, ``2.5d_layernorm``, ``2.5d_embedding``,
``2.5d_vocab_embedding`` and ``2.5d_attention``; ``GPT_2P5D_PLAN`` converts the reference GPT,
through ``parallelize_2p5d(model, mesh=mesh)`` (depth bound: every check first) or
``parallelize(model, plan=GPT_2P5D_PLAN, mesh=mesh)`` (the styles find the grid in the mesh).
"""

from tessera.tensor_parallel.two_p5_d.activations import activation_bytes_2p5d
from tessera.tensor_parallel.two_p5_d.grid import DepthShardSpec, Grid2p5D, check_batch_2p5d, tesseract_side
from tessera.tensor_parallel.two_p5_d.layers import (
    Embedding2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    VocabEmbedding2p5D,
    depth_replica,
)
from tessera.tensor_parallel.two_p5_d.loss import batch_block_2p5d, cross_entropy_2p5d, loss_2p5d
from tessera.tensor_parallel.two_p5_d.plans import (
    GPT_2P5D_PLAN,
    GPT_2P5D_VOCAB_PLAN,
    bind_2p5d,
    parallelize_2p5d,
    to_2p5d,
)
from tessera.tensor_parallel.two_p5_d.styles import Style2p5D, Styles2p5D, register

__all__ = [
    "GPT_2P5D_PLAN",
    "GPT_2P5D_VOCAB_PLAN",
    "DepthShardSpec",
    "Embedding2p5D",
    "Grid2p5D",
    "LayerNorm2p5D",
    "Linear2p5D",
    "Style2p5D",
    "Styles2p5D",
    "VocabEmbedding2p5D",
    "activation_bytes_2p5d",
    "batch_block_2p5d",
    "bind_2p5d",
    "check_batch_2p5d",
    "cross_entropy_2p5d",
    "depth_replica",
    "loss_2p5d",
    "parallelize_2p5d",
    "register",
    "tesseract_side",
    "to_2p5d",
]
