"""Early, clear refusals: the configuration and the model/optimizer layouts ZeRO cannot take.

Everything here runs before any collective, so every rank raises the same ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tessera.zero.flat import BUCKET_BYTES
from tessera.zero.precision import compute_dtype

__all__ = ["ZeroOptions", "collect_params", "resolve_device"]

_REFUSED_OPTIMIZERS = {
    "LBFGS": "it re-evaluates a closure and needs whole-model directions, not elementwise shards",
    "SparseAdam": "it needs sparse gradients, and ZeRO reduces dense flat buffers",
}


@dataclass(frozen=True, slots=True)
class ZeroOptions:
    """The validated options of a ZeroOptimizer."""

    stage: int
    precision: str = "fp32"
    offload: bool = False
    clip_grad_norm: float | None = None
    bucket_bytes: int = BUCKET_BYTES

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0 (plain data parallelism), 1, 2 or 3, got {self.stage}")
        compute_dtype(self.precision)
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0 or None, got {self.clip_grad_norm}")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes}")


def _names(params: list[nn.Parameter], name_of: dict[int, str], limit: int = 5) -> str:
    shown = [name_of.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in params[:limit]]
    more = f" and {len(params) - limit} more" if len(params) > limit else ""
    return ", ".join(shown) + more


def collect_params(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, deferred: bool = False
) -> tuple[list[tuple[str, nn.Parameter]], dict[int, int]]:
    """The model's distinct parameters with their first names, in registration order, and
    the optimizer group of each (by ``id``); a frozen parameter (``requires_grad=False``),
    in an optimizer group or not, is in the pseudo-group ``len(optimizer.param_groups)``.
    Raises ValueError, naming the parameters, for a layout ZeRO cannot shard:

    - an optimizer it does not support, or one that has already stepped;
    - parameters that are not floating point, on several devices, or distinct
      parameters sharing one storage (tie weights by sharing the Parameter object instead);
    - parameters on the meta device unless ``deferred`` (a value is given for each);
    - trainable parameters in no optimizer group, or optimizer parameters outside the model.
    """
    kind = type(optimizer).__name__
    if kind in _REFUSED_OPTIMIZERS:
        raise ValueError(f"ZeRO cannot shard {kind}: {_REFUSED_OPTIMIZERS[kind]}")
    if len(optimizer.state) > 0:
        raise ValueError(
            f"the {kind} optimizer already holds state for {len(optimizer.state)} parameters; build the "
            "ZeroOptimizer before the first step (load saved state with ZeroOptimizer.load)"
        )
    named = list(model.named_parameters())  # one entry per distinct Parameter (tied ones once)
    if not named:
        raise ValueError("the model has no parameters")
    name_of = {id(p): n for n, p in named}
    bad = [p for _, p in named if not p.is_floating_point()]
    if bad:
        raise ValueError(f"parameters must be floating point: {_names(bad, name_of)}")
    meta = [p for _, p in named if p.is_meta]
    if meta and not deferred:
        raise ValueError(
            f"parameters on the meta device ({_names(meta, name_of)}) and no init= to give them values"
        )
    devices = sorted({str(p.device) for _, p in named if not p.is_meta})
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, found {devices}")
    storages: dict[int, str] = {}
    for n, p in named:
        if p.is_meta:
            continue
        ptr = p.untyped_storage().data_ptr()
        if ptr in storages and p.numel() > 0:
            raise ValueError(
                f"parameters {storages[ptr]!r} and {n!r} are distinct Parameters sharing one storage; "
                "ZeRO would untie them. Tie weights by assigning the same Parameter to both modules"
            )
        storages.setdefault(ptr, n)
    group_of: dict[int, int] = {}
    outside: list[nn.Parameter] = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in name_of:
                outside.append(p)
            group_of[id(p)] = gi
    if outside:
        raise ValueError(
            f"{len(outside)} optimizer parameters are not parameters of the model "
            f"(shapes {[tuple(p.shape) for p in outside[:5]]}); ZeRO shards exactly the model's parameters"
        )
    missing = [p for _, p in named if id(p) not in group_of and p.requires_grad]
    if missing:
        raise ValueError(
            f"{len(missing)} model parameters are in no optimizer group: {_names(missing, name_of)}; "
            "ZeRO needs every trainable parameter in exactly one group"
        )
    frozen = len(optimizer.param_groups)  # the pseudo-group of parameters that take no gradient
    group_of.update({id(p): frozen for _, p in named if not p.requires_grad})
    return named, group_of


def resolve_device(named: Sequence[tuple[str, nn.Parameter]], device: torch.device | None) -> torch.device:
    """``device``, else the one the model's real parameters are on; refused when neither says."""
    real = next((p.device for _, p in named if not p.is_meta), None)
    if device is None and real is None:
        raise ValueError(
            "every parameter is on the meta device: give ZeroOptimizer(device=...) to build it on"
        )
    if device is not None and real is not None and torch.device(device) != real:
        raise ValueError(f"device={device} but the model's parameters are on {real}")
    return torch.device(device) if device is not None else real  # type: ignore[return-value]
