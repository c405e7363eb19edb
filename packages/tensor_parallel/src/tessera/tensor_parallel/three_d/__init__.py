"""3D tensor parallelism (Agarwal et al.'s 3D matmul, as Colossal-AI's legacy 3D layers)
over a q x q x q cube (tp = q**3, tp rank ``c*q*q + b*q + a``).

Activations (batch/q^2, ..., hidden/q) are cut over all three axes: in the *stream* layout
(residual stream, embeddings, norms) batch block ``b*q + a`` and hidden block c; in the
*branch* layout (inside attention and the MLP, the logits) batch block ``b*q + c`` and
hidden block a. ``Linear3D`` goes from one to the other (all-gather X along one line, W
along ``tp_weight``, reduce-scatter Y along the third). ``LayerNorm3D``, ``Embedding3D``
(hidden-split), ``VocabEmbedding3D`` (vocabulary-split) and the classifier loss
``cross_entropy_3d`` keep the layouts. Importing this package registers the styles
``3d_linear``, ``3d_linear_back``, ``3d_classifier``, ``3d_layernorm``, ``3d_embedding``,
``3d_vocab_embedding`` and ``3d_attention``; ``GPT_3D_PLAN`` (``GPT_3D_VOCAB_PLAN``: token
embedding vocabulary-split) converts the reference GPT through
``parallelize(model, plan=GPT_3D_PLAN, mesh=mesh)`` over a mesh of tp_mode 3d.
"""

from tessera.tensor_parallel.three_d.activations import activation_bytes_3d
from tessera.tensor_parallel.three_d.cube import (
    Cube3D,
    CubeShardSpec,
    check_cube_divisible,
    cube_coords,
    cube_side,
)
from tessera.tensor_parallel.three_d.embedding import EMBEDDING_SPEC, Embedding3D
from tessera.tensor_parallel.three_d.layernorm import LayerNorm3D, norm_spec
from tessera.tensor_parallel.three_d.linear import (
    Linear3D,
    bias_spec,
    check_linear_3d,
    linear_3d,
    weight_spec,
)
from tessera.tensor_parallel.three_d.loss import batch_block, cross_entropy_3d, loss_3d
from tessera.tensor_parallel.three_d.plans import GPT_3D_PLAN, GPT_3D_VOCAB_PLAN, parallelize_3d
from tessera.tensor_parallel.three_d.styles import (
    Attention3DStyle,
    Embedding3DStyle,
    LayerNorm3DStyle,
    Linear3DStyle,
    Style3D,
    Styles3D,
    VocabEmbedding3DStyle,
    register,
)
from tessera.tensor_parallel.three_d.vocab_embedding import VOCAB_EMBEDDING_SPEC, VocabEmbedding3D

__all__ = [
    "EMBEDDING_SPEC",
    "GPT_3D_PLAN",
    "GPT_3D_VOCAB_PLAN",
    "VOCAB_EMBEDDING_SPEC",
    "Attention3DStyle",
    "Cube3D",
    "CubeShardSpec",
    "Embedding3D",
    "Embedding3DStyle",
    "LayerNorm3D",
    "LayerNorm3DStyle",
    "Linear3D",
    "Linear3DStyle",
    "Style3D",
    "Styles3D",
    "VocabEmbedding3D",
    "VocabEmbedding3DStyle",
    "activation_bytes_3d",
    "batch_block",
    "bias_spec",
    "check_cube_divisible",
    "check_linear_3d",
    "cross_entropy_3d",
    "cube_coords",
    "cube_side",
    "linear_3d",
    "loss_3d",
    "norm_spec",
    "parallelize_3d",
    "register",
    "weight_spec",
]
