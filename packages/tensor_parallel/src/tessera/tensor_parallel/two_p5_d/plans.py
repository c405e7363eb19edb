"""The 2.5D plan of the reference GPT, and binding a plan's 2.5D styles to a grid.

``GPT_2P5D_PLAN`` is ``GPT_2D_PLAN`` (``two_d.plans``) with every 2D style replaced by its
2.5D twin: inside each depth layer the model is the 2D model (every activation a 2D block,
attention unchanged on batch block ``k*q + i`` and heads block j); the depth layers hold
disjoint batch blocks and replicate every weight. Every element of an activation lives on
exactly one rank, so the residual dropouts draw from the per-rank ``split`` stream. The loss
is ``cross_entropy_2p5d`` on the vocabulary-split logits (``loss_2p5d``).
``GPT_2P5D_VOCAB_PLAN`` splits the token embedding on the vocabulary too.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from tessera.comm import Mesh
from tessera.tensor_parallel.parallelize import parallelize
from tessera.tensor_parallel.plan import Plan, PlanLike
from tessera.tensor_parallel.style import TPStyle
from tessera.tensor_parallel.two_d.plans import GPT_2D_PLAN
from tessera.tensor_parallel.two_p5_d.grid import Grid2p5D
from tessera.tensor_parallel.two_p5_d.styles import Style2p5D

__all__ = ["GPT_2P5D_PLAN", "GPT_2P5D_VOCAB_PLAN", "bind_2p5d", "parallelize_2p5d", "to_2p5d"]


def to_2p5d(plan: PlanLike, *, name: str | None = None) -> Plan:
    """``plan`` with each registered 2D style (``2d_...``) replaced by its 2.5D twin (``2.5d_...``)."""
    plan = plan if isinstance(plan, Plan) else Plan.of(plan)
    entries = {
        pattern: ("2.5" + style.name[1:] if style.name.startswith("2d_") else style)
        for pattern, style in plan.entries
    }
    return Plan.of(entries, name=name or f"{plan.name}_2p5d", supports_sequence_parallel=False)


GPT_2P5D_PLAN = to_2p5d(GPT_2D_PLAN, name="gpt_2p5d")

GPT_2P5D_VOCAB_PLAN = Plan.of(
    {**GPT_2P5D_PLAN.as_dict(), "embed.tok": "2.5d_vocab_embedding"},
    name="gpt_2p5d_vocab",
    supports_sequence_parallel=False,
)


def bind_2p5d(plan: PlanLike, grid: Grid2p5D) -> Plan:
    """``plan`` with each 2.5D style (given by name or object) bound to ``grid`` (its groups
    and depth: every check then runs before anything changes); other styles kept."""
    plan = plan if isinstance(plan, Plan) else Plan.of(plan)
    entries: list[tuple[str, TPStyle]] = [
        (
            pattern,
            dataclasses.replace(style, grid=grid, depth=grid.d) if isinstance(style, Style2p5D) else style,
        )
        for pattern, style in plan.entries
    ]
    return Plan(tuple(entries), plan.name, plan.supports_sequence_parallel, plan.optional)


def parallelize_2p5d(
    model: nn.Module, *, plan: PlanLike = GPT_2P5D_PLAN, mesh: Mesh, seed: int = 0
) -> nn.Module:
    """``parallelize(model, plan=bind_2p5d(plan, grid), mesh=mesh)`` for ``mesh``'s 2.5D grid (its
    topology must have tp_mode 2.5d); every check runs before anything changes or communicates."""
    grid = Grid2p5D.from_mesh(mesh)
    return parallelize(model, plan=bind_2p5d(plan, grid), mesh=mesh, seed=seed)
