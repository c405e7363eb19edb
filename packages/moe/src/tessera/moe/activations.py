"""The activations of an expert bank (`tessera.moe.experts.Experts`): gated ones, computed from
a gate ``g = x @ w1`` and an up projection ``u = x @ w3``, and non-gated ones, from ``g`` alone.

- ``"swiglu"``: ``silu(g) * u`` (Mixtral and most);
- ``"geglu_tanh"``: ``gelu_tanh(g) * u``, GELU's tanh approximation gating the up projection
  (Gemma 4's experts: ``gelu_pytorch_tanh``);
- ``"gelu"``: ``gelu(g)``, ``"relu2"``: ``relu(g) ** 2`` (non-gated; Nemotron-H's experts);
- `ClampedSwiGLU`: GPT-OSS's ``(u.clamp(-limit, limit) + 1) * g' * sigmoid(alpha * g')`` with
  ``g' = g.clamp(max=limit)``;
- `SwiGLUVariant`: a SwiGLU with the clamps, softcaps and offset that other families add
  (HunYuan-V4's clamped gate and up, Ling's clip after the activation, Inkling 2's softcaps).

Every one acts on each hidden unit alone, so a bank split over its hidden units (tensor
parallelism) computes it share by share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "ClampedSwiGLU",
    "SwiGLUVariant",
    "activate",
    "check_activation",
    "is_gated",
]


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    """GPT-OSS's SwiGLU: ``(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g =
    gate.clamp(max=limit)`` (``swiglu_alpha``, ``swiglu_limit`` of its config)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        gate = gate.clamp(max=self.limit)
        # (up + 1) * (g * sigmoid(alpha g)), grouped as GPT-OSS's: the same bf16 roundings
        return (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))


def _softcap(x: Tensor, cap: float | None) -> Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


@dataclass(frozen=True, slots=True)
class SwiGLUVariant:
    """A SwiGLU with clamps and softcaps: ``act * (u' + up_offset)`` where, in this order,

    - ``g = gate.clamp(max=gate_limit)`` (with ``gate_limit``; else the gate as it is),
    - ``act = softcap(g, gate_softcap) * sigmoid(alpha * g)`` (``softcap(x, c) = c * tanh(x / c)``;
      the sigmoid sees ``g`` itself), then ``act.clamp(max=act_limit)`` with ``act_limit``,
    - ``u' = softcap(up.clamp(-up_limit, up_limit), up_softcap)`` (each where given).

    ``float32``: computed in float32 and cast back to the input's dtype. With no option set it
    is ``"swiglu"``; every limit and cap must be > 0."""

    alpha: float = 1.0
    gate_limit: float | None = None
    up_limit: float | None = None
    act_limit: float | None = None
    gate_softcap: float | None = None
    up_softcap: float | None = None
    up_offset: float = 0.0
    float32: bool = False

    def __post_init__(self) -> None:
        named = {
            "gate_limit": self.gate_limit,
            "up_limit": self.up_limit,
            "act_limit": self.act_limit,
            "gate_softcap": self.gate_softcap,
            "up_softcap": self.up_softcap,
        }
        bad = {k: v for k, v in named.items() if v is not None and not v > 0}
        if bad:
            raise ValueError(f"SwiGLUVariant: limits and softcaps must be > 0 or None, got {bad}")

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        dtype = gate.dtype
        if self.float32:
            gate, up = gate.float(), up.float()
        g = gate if self.gate_limit is None else gate.clamp(max=self.gate_limit)
        if self.gate_softcap is None and self.alpha == 1:
            act = F.silu(g)
        else:
            act = _softcap(g, self.gate_softcap) * torch.sigmoid(g * self.alpha)
        if self.act_limit is not None:
            act = act.clamp(max=self.act_limit)
        u = up if self.up_limit is None else up.clamp(-self.up_limit, self.up_limit)
        u = _softcap(u, self.up_softcap)
        out = act * (u + self.up_offset) if self.up_offset else act * u
        return out.to(dtype)


Activation = Literal["swiglu", "gelu", "relu2", "geglu_tanh"] | ClampedSwiGLU | SwiGLUVariant
ACTIVATIONS = ("swiglu", "gelu", "relu2", "geglu_tanh")  # by name; and any `ClampedSwiGLU` or `SwiGLUVariant`
_NOT_GATED = ("gelu", "relu2")


def is_gated(activation: Activation) -> bool:
    """Whether ``activation`` takes an up projection (``w3``) beside the gate."""
    return not (isinstance(activation, str) and activation in _NOT_GATED)


def check_activation(activation: object) -> None:
    """ValueError naming ``activation`` unless it is one of `ACTIVATIONS` or a parameterised one."""
    if not isinstance(activation, ClampedSwiGLU | SwiGLUVariant) and activation not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {ACTIVATIONS}, got {activation!r}; or give a ClampedSwiGLU or "
            "SwiGLUVariant"
        )


def activate(activation: Activation, gate: Tensor, up: Tensor | None) -> Tensor:
    """The hidden units from ``gate`` (and ``up``, for a gated ``activation``)."""
    if up is None:
        if activation == "gelu":
            return F.gelu(gate)
        if activation == "relu2":
            return torch.square(F.relu(gate))
        raise ValueError(f"activation {activation!r} needs an up projection")
    if isinstance(activation, ClampedSwiGLU | SwiGLUVariant):
        return activation(gate, up)
    if activation == "geglu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up
