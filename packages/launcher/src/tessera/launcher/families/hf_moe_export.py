"""A converted Hugging Face mixture's tensors as transformers' tensors, both ways.

`exported_parts`: each tensor of a `hf_moe.moe_from_hf` layer as parts of the HF block's
tensors (``tessera.launcher.checkpoint.exported``), which ``boost()``'s exports, consolidated
files, imports and deferred initialization all follow: the experts' as
``hf_moe_banks.bank_parts`` lays out each bank (``w1`` / ``w3`` the gate / up band of
``experts.gate_up_proj``, ``w2`` ``experts.down_proj``, ...), the router's and shared experts'
tensors (`block_parts` adds the older per-expert layout).
`hf_moe_state_dict`: a converted model's state dict under transformers' names again, joined
through those parts (the way back, for a model converted by hand).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from torch import Tensor, nn

from tessera.launcher.checkpoint.exported import Band, ExportPart, Joiner, parts_of
from tessera.launcher.families.hf_gemma4 import HOLDER, is_layer_mixture, layer_parts
from tessera.launcher.families.hf_moe_banks import bank_parts
from tessera.launcher.families.hf_moe_kept import kept_kind, kept_parts
from tessera.launcher.families.hf_moe_routing import HFLayout, read_layout
from tessera.launcher.families.hf_names import per_expert

__all__ = [
    "block_parts",
    "block_tensor",
    "exported_parts",
    "hf_moe_state_dict",
    "mixture_parts",
    "renamed_tensors",
]


def block_tensor(module: nn.Module, dotted: str) -> Tensor:
    """The parameter or buffer ``dotted`` of ``module``."""
    owner, _, name = dotted.rpartition(".")
    value = getattr(module.get_submodule(owner) if owner else module, name)
    if not isinstance(value, Tensor):
        raise ValueError(f"{type(module).__name__}.{dotted} is not a tensor")
    return value


def exported_parts(name: str, layout: HFLayout) -> dict[str, tuple[ExportPart, ...]]:
    """The converted layer's tensors (by their names in the model; ``name`` the block's) as
    parts of the block's (a hash router's table ``router.tid2eid`` the block's, as it is):
    the experts' (and GPT-OSS's expert biases) as `hf_moe_banks.bank_parts` lays out the bank
    (``w1`` / ``w3`` the gate / up band of ``experts.gate_up_proj``, ``w2`` ``experts.down_proj``,
    transposed where gate and up are rows), the shared expert's one-expert banks its
    ``nn.Linear`` weights transposed, the router's weight, bias, score bias and the shared gate
    as they are; as parts the per-expert tensors of checkpoints (`hf_names.per_expert`) are
    added after."""

    def part(
        rel: str, index: int | None = None, transpose: bool = False, band: Band | None = None
    ) -> tuple[ExportPart, ...]:
        return (ExportPart(f"{name}.{rel}", index, transpose, band),)

    out = {f"{name}.router.weight": part(layout.router_weight)}
    for w, parts in bank_parts(layout.bank, layout.experts, layout.hidden, layout.expert_norm).items():
        out[f"{name}.{w}"] = tuple(replace(p, name=f"{name}.{p.name}") for p in parts)
    if layout.router_bias is not None:
        out[f"{name}.router.bias"] = part(layout.router_bias)
    if layout.score_bias is not None:
        out[f"{name}.router.score_bias"] = part(layout.score_bias)
    if layout.hash_table is not None:  # DeepSeek-V4's tid2eid, a persistent int64 buffer
        out[f"{name}.router.tid2eid"] = part(layout.hash_table)
    if layout.shared is not None:
        for w, proj, band in layout.shared_projections:
            if layout.shared_stacked:  # Inkling's [S, out, in]: all S experts of the bank
                out[f"{name}.shared.{w}"] = part(f"{layout.shared}.{proj}", None, True, band)
            else:
                out[f"{name}.shared.{w}"] = part(f"{layout.shared}.{proj}.weight", 0, True, band)
    for ours, theirs, index in renamed_tensors(layout):
        out[f"{name}.{ours}"] = part(theirs, index)
    if layout.shared_gate is not None:
        out[f"{name}.shared_gate"] = part(f"{layout.shared_gate}.weight")
    if layout.post_norm is not None:
        out[f"{name}.post_norm"] = part(f"{layout.post_norm}.weight")
    if layout.out_bias is not None:  # JetMoE's output bias (`OutputBiasMoE.bias`)
        out[f"{name}.bias"] = part(layout.out_bias)
    return out


def renamed_tensors(layout: HFLayout) -> list[tuple[str, str, int | None]]:
    """The converted layer's further tensors that are one HF tensor each, relative to the block:
    ``(ours, HF's, index)``, ours the HF one (``index`` None) or with a first dim of 1 (``0``):
    Ergo's shared norm ``shared.norm [1, d]``, Inkling's ``router.scale`` (its ``global_scale``)."""
    out: list[tuple[str, str, int | None]] = []
    if layout.shared is not None and layout.shared_norm is not None:
        out.append(("shared.norm", f"{layout.shared}.{layout.shared_norm}", 0))
    if layout.router_scale is not None:
        out.append(("router.scale", layout.router_scale, None))
    return out


def block_parts(
    name: str, block: nn.Module, layout: HFLayout, merges: Mapping[str, tuple[str, ...]] | None = None
) -> dict[str, tuple[ExportPart, ...]]:
    """`exported_parts` of HF block ``block`` (at ``name``, read as ``layout``), with the
    per-expert tensors of its checkpoints (``merges``: `hf_names.expert_merges`) as older parts
    and a score-correction bias exported in the shape the block holds it (ERNIE's ``[1, E]``)."""
    exported = exported_parts(name, layout)
    if merges:
        exported = per_expert(exported, merges, layout.experts)
    if layout.score_bias is not None:  # exported as HF holds it (ERNIE's [1, E], the router's [E])
        shape = tuple(block_tensor(block, layout.score_bias).shape)
        (bias,) = exported[f"{name}.router.score_bias"]
        exported[f"{name}.router.score_bias"] = (replace(bias, view=shape if len(shape) > 1 else None),)
    return exported


def mixture_parts(
    name: str,
    module: nn.Module,
    merges: Mapping[str, tuple[str, ...]] | None = None,
    layout: HFLayout | None = None,
) -> dict[str, tuple[ExportPart, ...]]:
    """The export parts of the mixture converted from HF module ``module`` at ``name``: Gemma 4's
    decoder layer, which holds its mixture as ``moe`` (`hf_gemma4.layer_parts`, the experts' width
    read from its ``experts.gate_up_proj [E, 2h, d]``), or a sparse block (`block_parts`, read as
    ``layout``, else as `read_layout` reads it); with the per-expert tensors of ``merges`` as
    older parts. ``module``'s weights are not read (it may be on the meta device)."""
    if is_layer_mixture(module):
        experts, double, _ = module.get_parameter("experts.gate_up_proj").shape
        parts = layer_parts(name, double // 2)
        return per_expert(parts, merges, experts) if merges else parts
    if kept_kind(module) is not None:  # PhiMoE's, ZAYA's: its router kept as written (hf_moe_kept)
        return kept_parts(name, module, merges)
    return block_parts(name, module, layout or read_layout(module), merges)


def hf_moe_state_dict(state: Mapping[str, Tensor], *, like: nn.Module) -> dict[str, Tensor]:
    """A converted model's state dict (``convert_hf_moe``'s names, e.g. what ``consolidate``
    writes) under transformers' names again, so that the HF model loads it strictly: each
    converted layer's tensors joined into the tensors of the block at the same place in
    ``like`` (an unconverted model of the family, e.g. the one to load into; its weights are
    not read, so it may be on the meta device) as `block_parts` lays them out, streamed as
    ``consolidate`` streams them. Every other entry is kept as it is; ValueError naming an
    entry of a converted layer that transformers has no name for."""
    kept = {k.partition(".router.module.")[0] for k in state if ".router.module." in k}  # hf_moe_kept's
    layers = [
        k.removesuffix(".experts.w1")
        for k in state
        if k.endswith(".experts.w1")
        and (k.replace(".experts.w1", ".router.weight") in state or k.removesuffix(".experts.w1") in kept)
    ]
    exported: dict[str, tuple[ExportPart, ...]] = {}
    for layer in layers:
        owner, _, held = layer.rpartition(".")
        # Gemma 4's mixture is held by its decoder layer as `moe`; any other replaced its block
        name = owner if held == HOLDER and is_layer_mixture(like.get_submodule(owner)) else layer
        exported.update(mixture_parts(name, like.get_submodule(name)))
    joiner, out = Joiner(exported, list(state)), {}
    for name, value in state.items():
        if name not in exported and any(name.startswith(f"{layer}.") for layer in layers):
            raise ValueError(f"{name}: not a tessera.moe.MoE entry transformers has a name for")
        for part in parts_of(name, exported):
            tensor = joiner.add(part, part.take(value))
            if tensor is not None:
                out[part.name] = tensor
    return out
