"""Mixture-of-experts layers in the planner: what experts cost in memory per rank under
expert parallelism, and what their all-to-alls cost in bytes and time.

The layer is ``tessera.moe.MoE`` (`ExpertShape`): a router ``[E, d]``, ``E`` experts of width
``h`` (SwiGLU: three ``d x h`` matrices each; GELU: two), an optional shared expert, each
token to ``top_k`` experts. Under expert parallelism over ``ep`` of the ``dp`` data-parallel
ranks, each rank holds ``E / ep`` experts of every MoE layer; the router and the shared
expert are dense (on every rank). ZeRO shards the expert parameters over their
expert-data-parallel group (the ``dp / ep`` ranks holding the same experts) and the dense
ones over all ``dp``: `expert_memory` gives both parts with the planner's own
``model_state_bytes``, so ``ep = 1`` is plain data parallelism of the whole model.

Each MoE layer's forward moves the rows twice (dispatch to the experts' ranks, combine back)
and its backward twice more (their gradients): four all-to-alls per layer and microbatch. A
rank's dispatch buffer is its ``tokens * top_k`` assignments of ``d`` elements (at most
``E * capacity`` of them under a capacity factor); with routing spread evenly, ``(ep - 1) /
ep`` of it leaves the rank (`all_to_all_bytes`; `tessera.moe`'s meters count exactly the
rows that change rank), and each call first exchanges the per-expert counts (``8 * (E - E /
ep)`` bytes). `all_to_all_seconds` prices them on the cluster's link (`Link.all_to_all`).

`estimate` of a `Job` with ``moe`` at a `Layout` with ``ep`` is the dense model's changed by
`expert_change`: each MoE layer's dense MLP state replaced by the expert memory above, and
the all-to-alls added to the compute they block (``StepTime.compute`` and ``tensor_comm``).
It models experts under 1D tensor parallelism, with or without Megatron SP (every expert's
and the shared expert's hidden units split over tp, the router whole: the launcher's ``moe``
style, whose region gathers the sequence as the MLP's it replaces does), not with pipeline
or context parallelism (`check` refuses those).
The compute of the experts is the dense MLP's when ``top_k * hidden`` equals its width (each
token runs ``top_k`` experts); otherwise the difference is not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.planner.links import Link
from tessera.planner.memory import DTYPE_BYTES, model_state_bytes
from tessera.planner.model import ModelShape

__all__ = [
    "A2A_PER_LAYER",
    "ExpertChange",
    "ExpertMemory",
    "ExpertShape",
    "all_to_all_bytes",
    "all_to_all_seconds",
    "expert_change",
    "expert_memory",
    "kept_assignments",
]

A2A_PER_LAYER = 4  # dispatch and combine forward, their gradients backward


@dataclass(frozen=True, slots=True)
class ExpertShape:
    """The MoE layers of a model: ``layers`` of them, each ``experts`` MLPs ``d -> hidden ->
    d`` (``swiglu``: three matrices, else two) with ``top_k`` routing, ``capacity_factor``
    (None: drop-less) and a shared expert of ``shared_hidden`` (0: none)."""

    layers: int
    experts: int
    top_k: int
    hidden: int
    swiglu: bool = True
    shared_hidden: int = 0
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and experts ({self.experts})")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor}")

    def expert_params(self, d: int, tp: int = 1) -> int:
        """Elements of one expert of one layer (one tp rank's share of its hidden units)."""
        return (3 if self.swiglu else 2) * d * -(-self.hidden // tp)

    def dense_params(self, d: int, tp: int = 1) -> int:
        """Elements of one layer's router (whole on every rank) and shared expert (one tp
        rank's share of its hidden units; every dp rank holds it)."""
        shared = (3 if self.swiglu else 2) * d * -(-self.shared_hidden // tp)
        return self.experts * d + shared


@dataclass(frozen=True, slots=True)
class ExpertMemory:
    """Bytes one rank holds for the MoE layers at the peak of a step: ``experts`` (its
    ``E / ep`` experts' parameters, gradients and optimizer state) and ``dense`` (routers
    and shared experts), and the expert elements it holds (``psi``)."""

    experts: float
    dense: float
    psi: int

    @property
    def total(self) -> float:
        """Both parts."""
        return self.experts + self.dense


def _state(psi: float, stage: int, n: int, precision: str, optimizer: str, offload: bool) -> float:
    params, grads, state, host = model_state_bytes(
        psi, stage=stage, n=n, precision=precision, offload=offload, optimizer=optimizer
    )
    return params + grads + state - host


def expert_memory(
    moe: ExpertShape,
    d: int,
    *,
    ep: int,
    dp: int,
    stage: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    offload: bool = False,
) -> ExpertMemory:
    """What one rank holds of ``moe``'s layers (width ``d``) at ``ep`` of ``dp`` ranks and
    ZeRO ``stage``: ``E / ep`` experts per layer, their state sharded over ``dp / ep``
    ranks; routers and shared experts whole, sharded over ``dp``. Device bytes (offloaded
    state not counted)."""
    if ep < 1 or dp % ep or moe.experts % ep:
        raise ValueError(f"ep={ep} must divide dp={dp} and the experts ({moe.experts})")
    psi = moe.layers * (moe.experts // ep) * moe.expert_params(d)
    dense = moe.layers * moe.dense_params(d)
    return ExpertMemory(
        experts=_state(psi, stage, dp // ep, precision, optimizer, offload),
        dense=_state(dense, stage, dp, precision, optimizer, offload),
        psi=psi,
    )


def kept_assignments(moe: ExpertShape, tokens: int) -> int:
    """Assignments of a call's ``tokens`` that reach an expert: ``tokens * top_k``, at most
    ``E * ceil(factor * tokens * top_k / E)`` (each expert's capacity) with a capacity factor."""
    routed = tokens * moe.top_k
    if moe.capacity_factor is None:
        return routed
    return min(routed, moe.experts * math.ceil(moe.capacity_factor * routed / moe.experts))


def all_to_all_bytes(moe: ExpertShape, tokens: int, d: int, *, ep: int, precision: str = "fp32") -> float:
    """Bytes one rank sends to other ranks in one MoE layer's dispatch of ``tokens`` tokens
    with evenly spread routing: ``(ep - 1) / ep`` of its kept assignments' rows of ``d``
    elements, plus ``8 * (E - E / ep)`` bytes of counts. The combine returns as many rows,
    and the backward moves both again (`A2A_PER_LAYER`)."""
    if ep == 1:
        return 0.0
    rows = kept_assignments(moe, tokens) * (ep - 1) / ep
    return rows * d * DTYPE_BYTES[precision] + 8 * (moe.experts - moe.experts // ep)


def all_to_all_seconds(
    moe: ExpertShape, tokens: int, d: int, *, ep: int, microbatches: int, link: Link, precision: str = "fp32"
) -> float:
    """Seconds of one step's expert all-to-alls on one rank: per MoE layer and microbatch of
    ``tokens`` tokens, four all-to-alls of the kept rows' buffer (``Link.all_to_all``, which
    sends ``(ep - 1) / ep`` of it) and one of the counts."""
    if ep == 1:
        return 0.0
    rows = kept_assignments(moe, tokens) * d * DTYPE_BYTES[precision]
    counts = 8 * moe.experts
    per_layer = A2A_PER_LAYER * link.all_to_all(rows, ep) + link.all_to_all(counts, ep)
    return moe.layers * microbatches * per_layer


@dataclass(frozen=True, slots=True)
class ExpertChange:
    """What experts change in the dense model's estimate of one rank: bytes of parameters,
    gradients, optimizer state and of those on the host (``state``), the all-to-all seconds
    of a step (``a2a``) and the parameter elements held (``psi``)."""

    state: tuple[float, float, float, float]
    a2a: float
    psi: int


def expert_change(
    moe: ExpertShape,
    model: ModelShape,
    *,
    dp: int,
    ep: int,
    microbatches: int,
    stage: int,
    tp: int = 1,
    offload: bool,
    precision: str,
    optimizer: str,
    link: Link,
) -> ExpertChange:
    """The mixture against the dense model: ``moe.layers`` MLPs' state (sharded over ``dp``;
    under 1D ``tp`` the rank's columns and rows of them, the output bias whole) out, the
    experts' (``E / ep`` per layer over ``dp / ep``, each rank its share of their hidden units)
    and the routers' and shared experts' (over ``dp``) in; the all-to-alls of ``microbatches`` microbatches on
    ``link``."""
    if ep < 1 or dp % ep or moe.experts % ep:
        raise ValueError(f"ep={ep} must divide dp={dp} and the experts ({moe.experts})")
    d, f, b = model.hidden, model.ffn, int(model.bias)
    mlp = moe.layers * (-(-(d * f + b * f + f * d) // tp) + b * d)  # the dense MLPs they replace
    experts = moe.layers * (moe.experts // ep) * moe.expert_params(d, tp)
    dense = moe.layers * moe.dense_params(d, tp)

    def state(psi: float, n: int) -> tuple[float, float, float, float]:
        return model_state_bytes(
            psi, stage=stage, n=n, precision=precision, offload=offload, optimizer=optimizer
        )

    parts = (state(experts, dp // ep), state(dense, dp), state(mlp, dp))
    p, g, s, h = (e + r - m for e, r, m in zip(*parts, strict=True))
    tokens = model.batch // (dp * microbatches) * model.seq
    a2a = all_to_all_seconds(moe, tokens, d, ep=ep, microbatches=microbatches, link=link, precision=precision)
    return ExpertChange((p, g, s, h), a2a, experts + dense - mlp)
