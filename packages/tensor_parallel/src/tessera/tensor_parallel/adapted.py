"""Layers carrying low-rank adapters, read by their layout (PEFT's LoRA ``Linear`` is one):
a dense ``base_layer`` and, per adapter name, ``lora_A`` / ``lora_B`` ModuleDicts of ``nn.Linear``.
How they split is ``adapters``; this module only reads them (the attention style and derived
roles see an adapted layer as its base)."""

from __future__ import annotations

from torch import nn

from tessera.tensor_parallel.layers import is_dense

__all__ = ["adapter_names", "dense_core", "has_adapters"]


def has_adapters(module: nn.Module) -> bool:
    """Whether ``module`` wraps a ``base_layer`` with low-rank adapters (of any kind)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and any(
        isinstance(getattr(module, part, None), nn.ModuleDict | nn.ParameterDict)
        for part in ("lora_A", "lora_embedding_A")
    )


def adapter_names(module: nn.Module) -> tuple[str, ...] | None:
    """The adapter names of an adapted dense layer (see the module docstring), None for any
    other module (an adapted embedding included)."""
    if not has_adapters(module) or not is_dense(module.get_submodule("base_layer")):
        return None
    a, b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if not isinstance(a, nn.ModuleDict) or not isinstance(b, nn.ModuleDict) or set(a) != set(b):
        return None
    if not all(isinstance(m, nn.Linear) for m in [*a.values(), *b.values()]):
        return None
    return tuple(a)


def dense_core(module: nn.Module) -> nn.Module:
    """The dense layer that decides ``module``'s shape: its ``base_layer`` when it is adapted,
    else the module itself."""
    return module.get_submodule("base_layer") if adapter_names(module) is not None else module
