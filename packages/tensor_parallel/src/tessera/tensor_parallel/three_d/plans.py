"""The 3D plan of the reference GPT, and ``parallelize_3d``.

``GPT_3D_PLAN`` keeps the residual stream in the stream layout (batch block ``b*q + a`` of
q*q, hidden block c): embeddings, norms and the residual adds. Each sublayer leaves it by a
``3d_linear`` (q/k/v, fc_in) and comes back by a ``3d_linear_back`` (out_proj, fc_out).
Attention runs on its local block of the branch layout: batch block ``b*q + c`` (whole
sequences), heads block a (H/q heads, q must divide the heads). The classifier's logits are
in the branch layout, vocabulary block a (``cross_entropy_3d`` / ``loss_3d``).
``GPT_3D_VOCAB_PLAN`` is the same with the token embedding cut on the vocabulary too.
"""

from __future__ import annotations

from torch import nn

from tessera.comm import Mesh
from tessera.tensor_parallel.parallelize import parallelize
from tessera.tensor_parallel.plan import Plan, PlanLike
from tessera.tensor_parallel.three_d.cube import Cube3D
from tessera.tensor_parallel.three_d.styles import Styles3D as S

__all__ = ["GPT_3D_PLAN", "GPT_3D_VOCAB_PLAN", "parallelize_3d"]

GPT_3D_PLAN = Plan.of(
    {
        "embed.tok": S.EMBEDDING,
        "embed.pos": S.EMBEDDING,
        "embed.drop": "dropout_split",
        "layers.*.ln1": S.LAYERNORM,
        "layers.*.attn": S.ATTENTION,
        "layers.*.attn.q_proj": S.LINEAR,
        "layers.*.attn.k_proj": S.LINEAR,
        "layers.*.attn.v_proj": S.LINEAR,
        "layers.*.attn.out_proj": S.LINEAR_BACK,
        "layers.*.attn.resid_drop": "dropout_split",
        "layers.*.ln2": S.LAYERNORM,
        "layers.*.mlp.fc_in": S.LINEAR,
        "layers.*.mlp.fc_out": S.LINEAR_BACK,
        "layers.*.mlp.drop": "dropout_split",
        "head.ln_f": S.LAYERNORM,
        "head.lm_head": S.CLASSIFIER,
    },
    name="gpt_3d",
    supports_sequence_parallel=False,
)

GPT_3D_VOCAB_PLAN = Plan.of(
    {**GPT_3D_PLAN.as_dict(), "embed.tok": S.VOCAB_EMBEDDING},
    name="gpt_3d_vocab",
    supports_sequence_parallel=False,
)


def parallelize_3d(model: nn.Module, *, plan: PlanLike = GPT_3D_PLAN, mesh: Mesh, seed: int = 0) -> nn.Module:
    """``parallelize(model, plan=plan, mesh=mesh)`` after checking that ``mesh`` is a 3d one
    (tp = q**3); every check runs before anything changes or communicates."""
    Cube3D.from_mesh(mesh)
    return parallelize(model, plan=plan, mesh=mesh, seed=seed)
