"""The shared experts of transformers' sparse MoE blocks: each kind an MLP ``forward`` read
once from one class and recognised by its `source_key` (`SHARED_KINDS`): DeepSeek-V3's and
Llama 4's SwiGLU MLPs, Ling's with a limit, DeepSeek-V4's with its experts' clamps, Nemotron-H's
ReLU² (not gated), MiniMax-M3's with gate and up fused, Ergo's with a norm of its output,
Inkling's stacked ``[S, out, in]``; `read_shared` gives one in ``tessera.moe``'s terms (its
projections, width and activation), `shared_form` its count, stacking and norm. The routed
experts' banks are ``hf_moe_banks``'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from tessera.launcher.checkpoint.exported import Band
from tessera.launcher.families.hf_moe_banks import (
    read_deepseek_v4,
    read_minimax_m3,
    read_relu2,
    read_silu,
    silu_of,
)
from tessera.launcher.families.hf_moe_expert_norms import SHARED_NORM, read_norm
from tessera.launcher.families.hf_moe_kinds import SHARED_MLP, SHARED_MLP_LLAMA4, source_key
from tessera.moe import SwiGLUVariant
from tessera.moe.activations import Activation

__all__ = [
    "SHARED_KINDS",
    "SWIGLU_PROJECTIONS",
    "SWIGLU_SHARED",
    "SharedKind",
    "SharedProjections",
    "read_shared",
    "shared_form",
]


@dataclass(frozen=True, slots=True)
class SharedKind:
    """A shared expert MLP read from ``transformers.models.<like>``, recognised by ``key``: its
    projections ``w1`` / ``w3`` / ``w2`` (``nn.Linear`` s; no ``w3``: not gated; ``fused``: ``w1``
    and ``w3`` the first and second half of the rows of one, MiniMax-M3's ``gate_up_proj``), and
    ``activation(mlp)``; ``stacked``: the projections are parameters ``[S, out, in]`` of ``S``
    shared experts (Inkling's), not ``nn.Linear`` s; ``norm``: the RMS norm its output ends in
    (Ergo's, ``hf_moe_expert_norms.SHARED_NORM``)."""

    like: str
    key: str
    projections: tuple[tuple[str, str], ...]
    activation: Callable[[Any], Activation]
    fused: bool = False
    stacked: bool = False
    norm: str | None = None


SWIGLU_PROJECTIONS = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
SharedProjections = tuple[tuple[str, str, Band | None], ...]
"""A shared expert's ``(w, HF projection, its band of rows or None: the whole)`` each."""
SWIGLU_SHARED: SharedProjections = tuple((w, proj, None) for w, proj in SWIGLU_PROJECTIONS)


def _bailing_shared(mlp: Any) -> Activation:
    read_silu(mlp)
    limit = mlp.limit
    return "swiglu" if limit is None else SwiGLUVariant(act_limit=float(limit), up_limit=float(limit))


SHARED_KINDS: tuple[SharedKind, ...] = (
    SharedKind(SHARED_MLP[0], SHARED_MLP[1], SWIGLU_PROJECTIONS, read_silu),
    SharedKind(
        SHARED_MLP_LLAMA4[0],
        SHARED_MLP_LLAMA4[1],
        SWIGLU_PROJECTIONS,
        lambda mlp: silu_of(mlp.activation_fn),
    ),
    SharedKind("deepseek_v4.DeepseekV4MLP", "2e8c7fb2f8e54934", SWIGLU_PROJECTIONS, read_deepseek_v4),
    SharedKind("bailing_hybrid.BailingHybridMLP", "a95a93cb45ff3d54", SWIGLU_PROJECTIONS, _bailing_shared),
    SharedKind(
        "nemotron_h.NemotronHMLP", "bd0cd4577df6ef1d", (("w1", "up_proj"), ("w2", "down_proj")), read_relu2
    ),
    SharedKind(
        "minimax_m3_vl.MiniMaxM3VLDenseMLP",
        "8f8aba7f034ebf34",
        (("w1", "gate_up_proj"), ("w3", "gate_up_proj"), ("w2", "down_proj")),
        read_minimax_m3,
        fused=True,
    ),
    SharedKind(
        "ergo.ErgoSharedExpert",
        "9cac981e24ecbf9d",
        (("w1", "up_proj"), ("w2", "down_proj")),
        read_relu2,
        norm="norm",
    ),
    SharedKind(
        "inkling.InklingSharedExperts", "32aa077f88196684", SWIGLU_PROJECTIONS, read_silu, stacked=True
    ),
)


def shared_form(mlp: nn.Module, d_model: int) -> tuple[int, bool, str | None, float | None]:
    """Shared expert ``mlp``'s count of experts (``S`` of a stacked kind, else 1), whether it is
    stacked, and its norm's weight name (relative to ``mlp``) and epsilon (None, None: none)."""
    kind = next(k for k in SHARED_KINDS if k.key == source_key(type(mlp).forward))
    count = int(getattr(mlp, kind.projections[0][1]).shape[0]) if kind.stacked else 1
    if kind.norm is None:
        return count, kind.stacked, None, None
    norm, eps = read_norm(mlp, kind.norm, SHARED_NORM, (d_model,))
    return count, kind.stacked, norm, eps


def read_shared(mlp: nn.Module, where: str) -> tuple[SharedProjections, int, Activation]:
    """Shared expert ``mlp``'s projections (`SharedProjections`), hidden width and activation;
    ValueError naming ``where`` when no kind reads it or it has biases."""
    key = source_key(type(mlp).forward)
    kind = next((k for k in SHARED_KINDS if k.key == key), None)
    if kind is None:
        likes = ", ".join(k.like for k in SHARED_KINDS)
        raise ValueError(f"{where} ({type(mlp).__name__}) is not a shared MLP like {likes}")
    try:
        activation = kind.activation(mlp)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    for _, name in kind.projections:
        if getattr(getattr(mlp, name), "bias", None) is not None:  # (a stacked parameter has none)
            raise ValueError(f"{where}.{name} has a bias; tessera.moe's shared expert has none")
    down = getattr(mlp, kind.projections[-1][1])
    hidden = int((down if kind.stacked else down.weight).shape[-1])  # down: [d, h] or [S, d, h]
    halves = {"w1": Band(-2, 0, hidden), "w3": Band(-2, hidden, 2 * hidden)} if kind.fused else {}
    return tuple((w, proj, halves.get(w)) for w, proj in kind.projections), hidden, activation
