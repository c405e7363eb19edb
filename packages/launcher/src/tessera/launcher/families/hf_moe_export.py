"""A converted Hugging Face mixture's tensors as transformers' tensors, both ways.

`exported_parts`: each tensor of a `hf_moe.moe_from_hf` layer as parts of the HF block's
tensors (``tessera.launcher.checkpoint.exported``), which ``boost()``'s exports, consolidated
files, imports and deferred initialization all follow: ``w1`` / ``w3`` the gate / up band of
``experts.gate_up_proj`` (rows, columns, or alternating columns as the bank lays them out),
``w2`` ``experts.down_proj``, the `PART_LAYOUTS` banks as `bank_parts` lays them out, the
router's and shared experts' tensors. `hf_moe_state_dict`: a converted model's state dict under
transformers' names again (the way back, for a model converted by hand).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import Tensor, nn

from tessera.launcher.checkpoint.exported import Band, ExportPart
from tessera.launcher.families.hf_moe_banks import PART_LAYOUTS, bank_parts, bank_state
from tessera.launcher.families.hf_moe_routing import HFLayout, read_layout
from tessera.launcher.families.hf_moe_shared import SWIGLU_SHARED

__all__ = ["block_tensor", "exported_parts", "hf_moe_state_dict", "renamed_tensors"]


def block_tensor(module: nn.Module, dotted: str) -> Tensor:
    """The parameter or buffer ``dotted`` of ``module``."""
    owner, _, name = dotted.rpartition(".")
    value = getattr(module.get_submodule(owner) if owner else module, name)
    if not isinstance(value, Tensor):
        raise ValueError(f"{type(module).__name__}.{dotted} is not a tensor")
    return value


def exported_parts(name: str, layout: HFLayout) -> dict[str, tuple[ExportPart, ...]]:
    """The converted layer's tensors (by their names in the model; ``name`` the block's) as
    parts of the block's: ``w1`` / ``w3`` the gate / up band of ``experts.gate_up_proj`` as
    `_gate_up_bands` lays it out, ``w2`` ``experts.down_proj`` (transposed where gate and up are
    rows), GPT-OSS's expert biases the same bands of ``gate_up_proj_bias`` and
    ``down_proj_bias``, the shared expert's one-expert banks its ``nn.Linear`` weights
    transposed, the router's weight, bias, score bias and the shared gate as they are; as
    parts the per-expert tensors of checkpoints (`hf_names.per_expert`) are added after."""

    def part(
        rel: str, index: int | None = None, transpose: bool = False, band: Band | None = None
    ) -> tuple[ExportPart, ...]:
        return (ExportPart(f"{name}.{rel}", index, transpose, band),)

    rows = not layout.columns  # Mixtral's [E, 2h, d]: nn.Linear's layout, transposed

    def bank(fused: str, band: Band | None) -> tuple[ExportPart, ...]:
        return (ExportPart(f"{name}.experts.{fused}", transpose=rows, band=band),)

    out = {f"{name}.router.weight": part(layout.router_weight)}
    if layout.bank in PART_LAYOUTS:  # Nemotron-H's, DBRX's: as `bank_parts` lays them out
        for w, parts in bank_parts(layout.bank, layout.experts, layout.hidden, layout.expert_norm).items():
            out[f"{name}.{w}"] = tuple(replace(p, name=f"{name}.{p.name}") for p in parts)
    else:
        gate, up = _gate_up_bands(layout.bank, layout.hidden)
        out[f"{name}.experts.w1"] = bank("gate_up_proj", gate)
        out[f"{name}.experts.w3"] = bank("gate_up_proj", up)
        out[f"{name}.experts.w2"] = bank("down_proj", None)
    if layout.bank == "interleaved":  # GPT-OSS's biases, laid out as its weights' columns
        out[f"{name}.experts.b1"] = (ExportPart(f"{name}.experts.gate_up_proj_bias", band=gate),)
        out[f"{name}.experts.b3"] = (ExportPart(f"{name}.experts.gate_up_proj_bias", band=up),)
        out[f"{name}.experts.b2"] = (ExportPart(f"{name}.experts.down_proj_bias"),)
    if layout.router_bias is not None:
        out[f"{name}.router.bias"] = part(layout.router_bias)
    if layout.score_bias is not None:
        out[f"{name}.router.score_bias"] = part(layout.score_bias)
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


def _gate_up_bands(bank: str, h: int) -> tuple[Band, Band]:
    """Where gate and up sit in HF's fused ``gate_up_proj`` as ``bank`` (`BankLayout`) lays it
    out: rows ``0:h`` and ``h:2h`` of ``[E, 2h, d]``, columns ``0:h`` and ``h:2h`` of ``[E, d,
    2h]``, or its even and odd columns (alternating; its bias ``[E, 2h]`` alike)."""
    if bank == "interleaved":
        return Band(-1, 0, 2 * h, 2), Band(-1, 1, 2 * h, 2)
    dim = -1 if bank == "columns" else -2
    return Band(dim, 0, h), Band(dim, h, 2 * h)


def _gate_up(gate: Tensor, up: Tensor, bank: str) -> Tensor:
    """HF's fused ``gate_up_proj`` (or its bias) from the bank's ``w1`` / ``w3`` (``b1`` / ``b3``)
    as ``bank`` (`BankLayout`) lays it out: rows ``[E, 2h, d]``, columns ``[E, d, 2h]``, or
    columns alternating gate and up (the biases ``[E, 2h]`` alternating too)."""
    if bank == "interleaved":
        return torch.stack([gate, up], dim=-1).flatten(-2)
    if bank == "columns":
        return torch.cat([gate, up], dim=-1)
    return torch.cat([gate.transpose(1, 2), up.transpose(1, 2)], dim=1)


_SWIGLU_NAMES = {f"shared.{w}": (proj, band) for w, proj, band in SWIGLU_SHARED}
_MIXTRAL_NAMES = ("gate.weight", "gate.e_score_correction_bias", "shared_expert", "shared_expert_gate")


def hf_moe_state_dict(state: Mapping[str, Tensor], like: nn.Module | None = None) -> dict[str, Tensor]:
    """A converted model's state dict (``convert_hf_moe``'s names, e.g. what ``consolidate``
    writes) under transformers' names again, so that the HF model loads it strictly: per MoE
    layer the router's weight (and score-correction bias), ``experts.gate_up_proj = [w1.T |
    w3.T]`` and ``experts.down_proj = w2.T`` per expert (Llama 4's, laid out by columns: ``[w1 |
    w3]`` and ``w2``), the shared expert's ``gate_proj`` /
    ``up_proj`` / ``down_proj`` and its gate. The names are those of ``like``'s blocks at the
    same places (an unconverted model of the family, e.g. the one to load into; its weights are
    not read, so it may be on the meta device); without it, Mixtral's and Qwen2-MoE's
    (``gate``, ``shared_expert``, ``shared_expert_gate``). Every other entry is kept as it is."""
    out: dict[str, Tensor] = {}
    layers = {
        k.removesuffix(".router.weight")
        for k in state
        if k.endswith(".router.weight") and k.replace(".router.weight", ".experts.w1") in state
    }
    names: dict[str, tuple[str, str | None, str | None, str | None]] = {}
    shapes: dict[str, torch.Size] = {}
    banks: dict[str, str] = {}  # the layers whose experts are not laid out by rows (Llama 4, GPT-OSS)
    router_biases: dict[str, str] = {}
    post_norms: dict[str, str] = {}  # the layers whose blocks normalise their output (AXK1)
    out_biases: dict[str, str] = {}  # the layers whose blocks add a bias to their output (JetMoE)
    projections: dict[str, dict[str, tuple[str, Band | None]]] = {}  # shared.w1 -> gate_proj, ...
    halves: dict[str, dict[int, Tensor]] = {}  # a fused shared projection's bands as they come
    joined: dict[str, dict[str, Tensor]] = {}  # the `PART_LAYOUTS` banks, joined from their parts
    renamed: dict[str, dict[str, tuple[str, int | None]]] = {}  # `_renamed`, by layer
    stacked: set[str] = set()  # the layers whose shared experts are stacked [S, out, in] (Inkling)
    for layer in layers:
        if like is None:
            names[layer] = _MIXTRAL_NAMES
            continue
        block = like.get_submodule(layer)
        layout: HFLayout = read_layout(block)
        names[layer] = (layout.router_weight, layout.score_bias, layout.shared, layout.shared_gate)
        projections[layer] = {f"shared.{w}": (hf, band) for w, hf, band in layout.shared_projections}
        renamed[layer] = {ours: (theirs, index) for ours, theirs, index in renamed_tensors(layout)}
        if layout.shared_stacked:
            stacked.add(layer)
        if layout.bank in PART_LAYOUTS:
            parts = bank_parts(layout.bank, layout.experts, layout.hidden, layout.expert_norm)
            joined[layer] = bank_state(layer, state, parts)
        elif layout.columns:
            banks[layer] = layout.bank
        if layout.router_bias is not None:
            router_biases[layer] = layout.router_bias
        if layout.post_norm is not None:
            post_norms[layer] = layout.post_norm
        if layout.out_bias is not None:
            out_biases[layer] = layout.out_bias
        if layout.score_bias is not None:
            shapes[layer] = block_tensor(block, layout.score_bias).shape
    for name, value in state.items():
        prefix = next((p for p in layers if name.startswith(p + ".")), None)
        if prefix is None:
            out[name] = value
            continue
        router, bias, shared, shared_gate = names[prefix]
        rest = name[len(prefix) + 1 :]
        if prefix in joined and rest in ("experts.w1", "experts.w3", "experts.w2", "experts.norm"):
            if rest == "experts.w1":
                out.update(joined[prefix])
        elif rest == "router.weight":
            out[f"{prefix}.{router}"] = value
        elif rest in renamed.get(prefix, {}):
            theirs, index = renamed[prefix][rest]
            out[f"{prefix}.{theirs}"] = value if index is None else value[index]
        elif rest == "router.score_bias" and bias is not None:
            out[f"{prefix}.{bias}"] = value.reshape(shapes.get(prefix, value.shape))
        elif rest == "router.bias" and prefix in router_biases:
            out[f"{prefix}.{router_biases[prefix]}"] = value
        elif rest in ("experts.w1", "experts.b1"):
            hf = "gate_up_proj" if rest == "experts.w1" else "gate_up_proj_bias"
            up = state[f"{prefix}.experts.{rest[-2]}3"]
            out[f"{prefix}.experts.{hf}"] = _gate_up(value, up, banks.get(prefix, "rows"))
        elif rest == "experts.w2":
            out[f"{prefix}.experts.down_proj"] = (
                value if prefix in banks else value.transpose(1, 2)
            ).contiguous()
        elif rest == "experts.b2" and banks.get(prefix) == "interleaved":
            out[f"{prefix}.experts.down_proj_bias"] = value
        elif rest.startswith("shared.w") and shared is not None:
            proj, band = projections.get(prefix, _SWIGLU_NAMES)[rest]
            hf_name = f"{prefix}.{shared}.{proj}" + ("" if prefix in stacked else ".weight")
            if prefix in stacked:  # Inkling's [S, out, in]
                out[hf_name] = value.transpose(1, 2).contiguous()
            elif band is None:
                out[hf_name] = value[0].t().contiguous()
            else:  # MiniMax-M3's gate_up_proj: gate rows, then up rows
                held = halves.setdefault(hf_name, {})
                held[band.start] = value[0].t()
                if len(held) == 2:
                    out[hf_name] = torch.cat([held[start] for start in sorted(held)]).contiguous()
        elif rest == "shared_gate" and shared_gate is not None:
            out[f"{prefix}.{shared_gate}.weight"] = value
        elif rest == "post_norm" and prefix in post_norms:
            out[f"{prefix}.{post_norms[prefix]}.weight"] = value
        elif rest == "bias":  # `OutputBiasMoE`'s output bias: the block's (JetMoE's ``bias``)
            out[f"{prefix}.{out_biases.get(prefix, 'bias')}"] = value
        elif rest not in ("experts.w3", "experts.b3"):
            raise ValueError(f"{name}: not a tessera.moe.MoE entry transformers has a name for")
    return out
