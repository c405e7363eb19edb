"""Layers carrying low-rank adapters, read by their layout (PEFT's LoRA ``Linear`` is one):
a dense ``base_layer`` and, per adapter name, ``lora_A`` / ``lora_B`` ModuleDicts of ``nn.Linear``.
How they split is ``adapters``; this module only reads them (the attention style and derived
roles see an adapted layer as its base). It also reads PEFT's ``modules_to_save`` wrapper: a
layer's frozen original beside a trained copy per adapter (`saved_copies`)."""

from __future__ import annotations

from torch import nn

from tessera.tensor_parallel.layers import is_dense

__all__ = ["adapter_names", "dense_core", "has_adapters", "saved_copies"]


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


def saved_copies(module: nn.Module) -> tuple[str, ...] | None:
    """The adapter names of a layer trained whole as a copy per adapter beside its frozen
    original (PEFT's ``modules_to_save``: an ``original_module`` and a ``modules_to_save``
    ModuleDict of copies), None for any other module."""
    copies = getattr(module, "modules_to_save", None)
    if not isinstance(getattr(module, "original_module", None), nn.Module) or not isinstance(
        copies, nn.ModuleDict
    ):
        return None
    return tuple(copies)


def dense_core(module: nn.Module) -> nn.Module:
    """The layer that decides ``module``'s shape: its ``base_layer`` when it is adapted, its
    ``original_module`` when it holds saved copies, else the module itself."""
    if saved_copies(module) is not None:
        return module.get_submodule("original_module")
    return module.get_submodule("base_layer") if adapter_names(module) is not None else module
