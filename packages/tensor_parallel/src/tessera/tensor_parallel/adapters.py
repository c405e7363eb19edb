"""Low-rank adapters on split layers: each adapter follows its base layer's split.

An *adapted* layer holds a dense ``base_layer`` (``nn.Linear`` or HF ``Conv1D``) and, for each
adapter name, a down projection ``lora_A[name]`` (in -> r) and an up projection ``lora_B[name]``
(r -> out), both ``nn.Linear``, and adds ``lora_B(lora_A(dropout(x))) * scaling`` to
``base_layer(x)``. PEFT's LoRA ``Linear`` is such a layer; it is read by its layout (PEFT is not
imported), and its own forward runs unchanged on the parallel parts. A plan entry that gives an
adapted layer ``colwise`` or ``rowwise`` gives its parts these (``expand``, called by
``resolve_plan``; the region and head refinements of the layer, such as split KV heads, carry
over):

- **colwise** (outputs split): ``base_layer`` and every ``lora_B`` split by outputs as the entry
  says (heads, fused parts); every ``lora_A`` whole. ``lora_B`` enters the tp region itself, as
  the base layer does (its r-wide input all-gathered along the sequence under SP, its gradient
  summed otherwise), so outside a region without SP ``lora_A``'s gradient is complete; inside a
  region or under SP it is partial and summed over tp (``coverage``'s rule for a whole parameter).
- **rowwise** (inputs split): ``base_layer`` and every ``lora_A`` split by inputs, each leaving
  the region (the adapter's r partial sums per token are all-reduced, or reduce-scattered under
  SP); every ``lora_B`` whole after that exit (`AfterExit`): its gradient complete, partial
  under SP.
- a ``lora_dropout[name]`` with p > 0 draws from the tp-aware stream of the tensor it sees:
  replicated for a colwise layer's whole input, split for a rowwise layer's split one or a
  sequence shard.

- **2D / 2.5D / 3D** (a ``DenseND`` entry: every activation split in blocks): ``lora_A`` (in -> r,
  unfused) and ``lora_B`` (r -> out, fused parts reordered as the base's) are two more of the
  mode's linears, chained; every whole parameter is partial there anyway. A 3D linear moves
  its input's cube layout to the other one, so ``lora_A`` moves its r-wide output back
  (``three_d.linear.mirror``) and ``lora_B``, oriented as the base, lands where the base's output
  lies (``DenseND.adapter_down``).

A style says which of these its layer's adapters take with ``adapter_split`` (``"columns"``,
``"rows"``, ``"blocks"``). Refused with a ValueError naming the layer: adapters under any other
style (an embedding's), adapter dropout under 2D/2.5D/3D, and adapter variants whose forward is
not that sum (DoRA's weight norm).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from tessera.tensor_parallel.adapted import adapter_names
from tessera.tensor_parallel.rng import ParallelDropout, RNGRegion
from tessera.tensor_parallel.style import ApplyContext, BaseStyle, Role, TPStyle, module_kind

__all__ = ["AdapterDropout", "AfterExit", "WholeAdapter", "expand"]


@dataclass(frozen=True, slots=True)
class AfterExit(BaseStyle):
    """A whole layer applied after its region's exit (a rowwise layer's adapter ``lora_B``):
    every rank computes it from the same summed activations, so its gradient is complete; under
    sequence parallelism it sees this rank's tokens only and its gradient is partial. ``coverage``
    reads ``after_exit``."""

    name: str = "after_exit"
    after_exit: bool = True


@dataclass(frozen=True, slots=True)
class WholeAdapter(BaseStyle):
    """A colwise layer's adapter ``lora_A``, kept whole: declared, so that ``coverage`` counts its
    gradient (partial inside a region or under SP) as planned."""

    name: str = "adapter_whole"


@dataclass(frozen=True, slots=True)
class AdapterDropout(BaseStyle):
    """An adapter's ``nn.Dropout`` -> ParallelDropout drawing from ``region``'s stream."""

    name: str = "adapter_dropout"
    role: Role = Role.DROPOUT
    region: RNGRegion = RNGRegion.REPLICATED

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        if not isinstance(module, nn.Dropout):
            raise ValueError(f"{name} ({self.name}): expected torch.nn.Dropout, got {module_kind(module)}")

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.Dropout)
        return ParallelDropout(module.p, ctx.rng, self.region)


def _variants(module: nn.Module) -> list[str]:
    """Adapter names whose forward is not the plain low-rank sum (DoRA and other variants)."""
    variant = getattr(module, "lora_variant", None)
    dora = getattr(module, "use_dora", None)
    named = set(variant) if isinstance(variant, Mapping) else set()
    if isinstance(dora, Mapping):
        named |= {k for k, on in dora.items() if on}
    return sorted(named)


def expand(
    name: str, module: nn.Module, style: TPStyle, *, sequence_parallel: bool, in_region: bool
) -> list[tuple[str, TPStyle]]:
    """The styles of an adapted layer's parts (names relative to it) when the plan gives the
    layer ``style`` (see the module docstring); ValueError naming the layer if it cannot take it."""
    names = adapter_names(module)
    if names is None:
        raise ValueError(
            f"{name} ({style.name}): {module_kind(module)} carries adapters on a "
            f"{module_kind(module.get_submodule('base_layer'))}; only adapters on dense layers "
            "(nn.Linear, HF Conv1D) split over tp: leave this layer out of the adapters' targets or "
            "train without tensor parallelism"
        )
    variants = _variants(module)
    if variants:
        raise ValueError(
            f"{name} ({style.name}): adapters {', '.join(variants)} are a variant (DoRA's weight norm) "
            "whose forward is not base + B(A(x)); they do not split over tp"
        )
    split = getattr(style, "adapter_split", None)
    if split not in ("columns", "rows", "blocks"):
        raise ValueError(
            f"{name} ({style.name}): adapters split only with a layer split by columns, rows or "
            f"blocks (colwise, rowwise, a 2D/2.5D/3D linear); this layer's style is {style.name}"
        )
    dropouts = getattr(module, "lora_dropout", None)
    out: list[tuple[str, TPStyle]] = [("base_layer", style)]
    for key in names:
        if split == "columns":
            out += [(f"lora_A.{key}", WholeAdapter()), (f"lora_B.{key}", style)]
            whole = in_region or not sequence_parallel  # the layer's input: whole, or a sequence shard
            region = RNGRegion.REPLICATED if whole else RNGRegion.SPLIT
        elif split == "rows":
            out += [(f"lora_A.{key}", style), (f"lora_B.{key}", AfterExit())]
            region = RNGRegion.SPLIT  # a rowwise layer's input is split by features
        else:  # A and B are two more of the mode's linears: (in -> r) unfused, (r -> out) as the base
            down: TPStyle = cast(Any, style).adapter_down()  # a DenseND
            out += [(f"lora_A.{key}", down), (f"lora_B.{key}", style)]
            region = RNGRegion.SPLIT
        drop = dropouts[key] if isinstance(dropouts, nn.ModuleDict) and key in dropouts else None
        if isinstance(drop, nn.Dropout) and drop.p > 0:
            if split == "blocks":
                raise ValueError(
                    f"{name}.lora_dropout.{key}: adapter dropout (p={drop.p}) under a 2D/2.5D/3D layer is "
                    "not built; set the adapters' dropout to 0"
                )
            out.append((f"lora_dropout.{key}", AdapterDropout(region=region)))
    return out
