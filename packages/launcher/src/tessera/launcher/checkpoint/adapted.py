"""What a model's low-rank adapters are, read before ``boost()`` converts it.

A layer carrying adapters (``tessera.tensor_parallel.adapters``: PEFT's LoRA ``Linear``)
computes ``base_layer(x) + sum_k scaling_k * lora_B[k](lora_A[k](x))``. Its merged weight is
``W + sum_k scaling_k * B_k @ A_k`` (transposed for an HF ``Conv1D`` base, which stores its weight
(in, out)). `Adapters` keeps, by the adapted layer's serial name, each adapter's scale and
whether the base is transposed, and the adapters' configurations as PEFT writes them
(``adapter_config.json``); `tessera.launcher.checkpoint.adapter_files` writes the files.
Adapters carried into a converted mixture of experts (``tessera.moe.adapters``, from PEFT's by
`tessera.launcher.families.hf_moe_adapters`) are kept apart, each with the PEFT module it came
from, so that the files keep PEFT's keys and the merge reaches the experts' stacked weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tessera.launcher.families.hf_moe_adapters import PEFT_SOURCES
from tessera.moe import MoE
from tessera.tensor_parallel.adapted import adapter_names, saved_copies

__all__ = [
    "AdaptedLayer",
    "Adapters",
    "ConvertedAdapter",
    "converted_adapters",
    "is_adapter_parameter",
    "read_adapters",
]


@dataclass(frozen=True, slots=True)
class AdaptedLayer:
    """One adapted layer: ``scaling`` by adapter name; ``transposed``: the base is an HF Conv1D."""

    scaling: Mapping[str, float]
    transposed: bool = False


@dataclass(frozen=True, slots=True)
class ConvertedAdapter:
    """An adapter of a converted mixture: ``sources``, the PEFT modules it came from (serial
    names, with PEFT's ``base_layer`` nesting; one per expert for a user's mixture); ``kind``
    (`hf_moe_adapters.to_peft`); ``adapter``, its name; ``scaling``; ``weights``, what its up
    projections change (``w1``, ``w3``, ``w2``; a router's: ``up``)."""

    sources: tuple[str, ...]
    kind: str
    adapter: str
    scaling: float
    weights: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Adapters:
    """The adapted layers by serial name, the adapters' configurations by adapter name (JSON-ready,
    as ``adapter_config.json`` holds them; empty when the model came without PEFT), and the layers
    trained as whole copies beside their frozen original (``modules_to_save``)."""

    layers: Mapping[str, AdaptedLayer] = field(default_factory=dict)
    configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    copies: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # saved layer -> adapter names
    converted: Mapping[str, ConvertedAdapter] = field(default_factory=dict)  # module -> its source

    def converted_of(self, name: str) -> str | None:
        """The converted adapter module serial parameter ``name`` lies in, None for any other."""
        module = name.rpartition(".up.")[0] if ".up." in name else name.rpartition(".")[0]
        return module if module in self.converted else None

    def copy_of(self, name: str) -> tuple[str, str | None, str] | None:
        """``(layer, adapter, rest)`` when serial parameter ``name`` lies in a layer kept beside
        trained copies (PEFT's ``modules_to_save``): the adapter whose copy holds it (None: the
        frozen original) and its name inside the layer; None for any other parameter."""
        for layer, names in self.copies.items():
            if not name.startswith(layer + "."):
                continue
            inner = name[len(layer) + 1 :]
            if inner.startswith("original_module."):
                return layer, None, inner.removeprefix("original_module.")
            for adapter in names:
                if inner.startswith(f"modules_to_save.{adapter}."):
                    return layer, adapter, inner.removeprefix(f"modules_to_save.{adapter}.")
        return None

    def trains_apart(self, name: str) -> bool:
        """Whether serial parameter ``name`` belongs to the adapters' files: an adapter's own, or
        a trained copy's."""
        found = self.copy_of(name)
        converted = self.converted_of(name) is not None
        return is_adapter_parameter(name) or converted or (found is not None and found[1] is not None)

    def owner(self, name: str) -> str | None:
        """The adapted layer a serial parameter name lies in, None for any other."""
        prefix = name
        while "." in prefix:
            prefix = prefix.rpartition(".")[0]
            if prefix in self.layers:
                return prefix
        return None


def is_adapter_parameter(name: str) -> bool:
    """Whether serial parameter ``name`` is an adapter's (a ``lora_*`` component, as PEFT counts)."""
    return any(part.startswith("lora_") for part in name.split("."))


def _json_ready(config: object) -> dict[str, Any]:
    to_dict = getattr(config, "to_dict", None)
    raw = to_dict() if callable(to_dict) else dict(vars(config))
    out = {}
    for key, value in raw.items():
        if isinstance(value, set | frozenset):
            value = sorted(value)
        out[key] = value
    return out


def read_adapters(model: nn.Module, configs: Mapping[str, object] | None = None) -> Adapters:
    """The adapters of the serial ``model`` and, given, their PEFT configurations."""
    layers = {}
    for name, module in model.named_modules():
        names = adapter_names(module)
        if names is None:
            continue
        scaling = getattr(module, "scaling", {})
        base = module.get_submodule("base_layer")
        layers[name] = AdaptedLayer(
            {k: float(scaling[k]) for k in names}, transposed=not isinstance(base, nn.Linear)
        )
    copies = {name: names for name, module in model.named_modules() if (names := saved_copies(module))}
    configured = {k: _json_ready(v) for k, v in (configs or {}).items()}
    return Adapters(layers, configured, copies, converted_adapters(model))


def converted_adapters(model: nn.Module) -> dict[str, ConvertedAdapter]:
    """The adapters carried into ``model``'s converted mixtures (their layers' ``peft_sources``),
    by adapter module."""
    out = {}
    for name, module in model.named_modules():
        sources = getattr(module, PEFT_SOURCES, None) if isinstance(module, MoE) else None
        for inner, found in (sources or {}).items():
            adapter = module.get_submodule(inner)
            up = adapter.up
            weights = tuple(up.keys()) if isinstance(up, nn.ParameterDict) else ("up",)
            bank, _, rest = inner.partition(".adapters.")
            kind = "per_expert" if bank == "experts" and len(found) > 1 else bank
            out[f"{name}.{inner}"] = ConvertedAdapter(
                tuple(f"{name}.{s}" for s in found), kind, rest.split(".")[0], float(adapter.scaling), weights
            )
    return out
