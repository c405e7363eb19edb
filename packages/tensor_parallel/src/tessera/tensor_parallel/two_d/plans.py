"""The 2D plan of the reference GPT, and binding a plan's 2D styles to a grid.

``GPT_2D_PLAN`` follows Colossal-AI's 2D GPT: every activation between layers is a 2D block
(batch block i, hidden block j); the token and position embeddings, every LayerNorm, the
q/k/v/out projections, both MLP linears and the LM head are 2D layers; attention runs
unchanged on its local block, batch block i and heads block j (H/q heads: q must divide the
head count). Every element of a 2D activation lives on exactly one rank, so the residual
dropouts draw from the per-rank ``split`` stream (``dropout_split``). The loss is
``cross_entropy_2d`` on the vocabulary-split logits (``loss_2d``). ``GPT_2D_VOCAB_PLAN`` is
the same with the token embedding split on the vocabulary too (``2d_vocab_embedding``).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from tessera.comm import Mesh
from tessera.tensor_parallel.parallelize import parallelize
from tessera.tensor_parallel.plan import Plan, PlanLike
from tessera.tensor_parallel.style import TPStyle
from tessera.tensor_parallel.two_d.grid import Grid2D
from tessera.tensor_parallel.two_d.styles import Style2D

__all__ = ["GPT_2D_PLAN", "GPT_2D_VOCAB_PLAN", "bind_2d", "parallelize_2d"]

GPT_2D_PLAN = Plan.of(
    {
        "embed.tok": "2d_embedding",
        "embed.pos": "2d_embedding",
        "embed.drop": "dropout_split",
        "layers.*.ln1": "2d_layernorm",
        "layers.*.attn": "2d_attention",
        "layers.*.attn.q_proj": "2d_linear",
        "layers.*.attn.k_proj": "2d_linear",
        "layers.*.attn.v_proj": "2d_linear",
        "layers.*.attn.out_proj": "2d_linear",
        "layers.*.attn.resid_drop": "dropout_split",
        "layers.*.ln2": "2d_layernorm",
        "layers.*.mlp.fc_in": "2d_linear",
        "layers.*.mlp.fc_out": "2d_linear",
        "layers.*.mlp.drop": "dropout_split",
        "head.ln_f": "2d_layernorm",
        "head.lm_head": "2d_classifier",
    },
    name="gpt_2d",
    supports_sequence_parallel=False,
)

GPT_2D_VOCAB_PLAN = Plan.of(
    {**GPT_2D_PLAN.as_dict(), "embed.tok": "2d_vocab_embedding"},
    name="gpt_2d_vocab",
    supports_sequence_parallel=False,
)


def bind_2d(plan: PlanLike, grid: Grid2D) -> Plan:
    """``plan`` with each 2D style (given by name or object) bound to ``grid``; others kept."""
    plan = plan if isinstance(plan, Plan) else Plan.of(plan)
    entries: list[tuple[str, TPStyle]] = [
        (pattern, dataclasses.replace(style, grid=grid) if isinstance(style, Style2D) else style)
        for pattern, style in plan.entries
    ]
    return Plan(tuple(entries), plan.name, plan.supports_sequence_parallel, plan.optional)


def parallelize_2d(model: nn.Module, *, plan: PlanLike = GPT_2D_PLAN, mesh: Mesh, seed: int = 0) -> nn.Module:
    """``parallelize(model, plan=bind_2d(plan, grid), mesh=mesh)`` for ``mesh``'s 2D grid (its
    topology must have tp_mode 2d); every check runs before anything changes or communicates."""
    grid = Grid2D.from_mesh(mesh)
    return parallelize(model, plan=bind_2d(plan, grid), mesh=mesh, seed=seed)
