"""Hugging Face sparse MoE blocks as ``tessera.moe.MoE`` layers: Mixtral, Qwen2/3-MoE, OLMoE,
DeepSeek-V2/V3, GraniteMoE, Llama 4, GPT-OSS and the families that copy their blocks (``hf_moe_routing``),
and those whose experts hold or compute otherwise (``hf_moe_banks``: Nemotron-H's non-gated ReLU²
experts, DBRX's ``mlp.w1`` / ``v1`` / ``w2``, Aria's columns, clamped and softcapped SwiGLUs,
JetMoE's ``input_linear`` / ``output_linear`` on the block, whose output bias makes the layer an
``tessera.moe.output_bias.OutputBiasMoE``), their tensors read, exported and written back
through the `ExportPart` s that name them.

Their blocks hold a router and experts ``experts.gate_up_proj [E, 2h, d]`` (gate rows, then
up rows) and ``experts.down_proj [E, d, h]`` computing ``down(silu(gate x) * up x)``, some a
shared SwiGLU expert (Qwen2-MoE's scaled per token by ``sigmoid(shared_expert_gate x)``).
`moe_from_hf` builds the `MoE` computing the same function with the same weights (``w1 =
gate.T``, ``w3 = up.T``, ``w2 = down.T`` per expert; drop-less, as HF routes every token; the
router as ``hf_moe_routing.read_layout`` reads it: softmax or sigmoid scores, DeepSeek-V3's
score-correction bias as the router's ``score_bias`` buffer, group-limited choice, the routed
scaling factor; Llama 4's experts, ``gate_up_proj [E, d, 2h]`` and ``down_proj [E, h, d]``, as
they are, weighing their inputs: ``weigh="input"``; GPT-OSS's router bias, expert biases and
clamped SwiGLU, its gate and up columns alternating; both in a `LogitsMoE` that returns ``(out,
None)`` where their decoder layers unpack the block's ``(out, router_logits)``), and
`convert_hf_moe` swaps every such block of a model for one, in place, so
that ``boost()`` trains it and ``parallel.ep`` can split its experts. Gemma 4's mixture has no
block: its decoder layer holds it, and is given it as one `MoE` under ``moe`` (``hf_gemma4``).
PhiMoE's and ZAYA's blocks keep their routers as transformers wrote them, their experts converted
(``hf_moe_kept``). A block it cannot reproduce is refused, naming why, before anything is
swapped. Dense layers between MoE ones (DeepSeek's ``first_k_dense_replace``, Qwen's
``mlp_only_layers``) are left as they are. HF's own router loss (from ``output_router_logits``)
is not kept: pass ``aux_loss_coef`` / ``z_loss_coef`` to train the routers with the layer's own
losses (`tessera.moe.aux`). `hf_moe_state_dict` maps a converted model's weights (what
``consolidate`` writes) back to transformers' names. The plans of roles of these families are
in ``hf_moe_plans``.

``boost()`` converts the blocks itself (`hf_moe_conversion`, at every ep) when the user did
not, keeping transformers' names in exports, ``consolidate`` and ``import_weights``: each
converted tensor is a part of the HF tensor it came from (``tessera.launcher.checkpoint.
exported``), with the per-expert tensors ``save_pretrained`` writes as the older layout an
import also reads (read from transformers' own conversion mapping: ``hf_names``); a deferred
model's banks are made from the HF tensors that HF's own ``_init_weights`` draws
(``train/deferred.py``), so they hold what an eager build holds.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from tessera.launcher.checkpoint.exported import ExportPart
from tessera.launcher.families.hf_dtypes import weighs_in_float32
from tessera.launcher.families.hf_gemma4 import (
    HOLDER,
    attach,
    is_layer_mixture,
    layer_mixture,
    mixture_modules,
)
from tessera.launcher.families.hf_moe_adapters import carry, is_wrapper, peel, peeled
from tessera.launcher.families.hf_moe_banks import (
    PART_LAYOUTS,
    bank_module,
    bank_parts,
    holds_bank,
    holds_parallel_experts,
    read_parts,
)
from tessera.launcher.families.hf_moe_export import (
    block_tensor,
    hf_moe_state_dict,
    mixture_parts,
    renamed_tensors,
)
from tessera.launcher.families.hf_moe_kept import kept_kind, kept_layer
from tessera.launcher.families.hf_moe_plans import MIXTRAL_PLAN, QWEN2_MOE_PLAN
from tessera.launcher.families.hf_moe_routing import HFLayout, read_layout
from tessera.launcher.families.hf_names import expert_merges
from tessera.launcher.families.own_moe import Conversion
from tessera.moe import MoE
from tessera.moe.activations import is_gated
from tessera.moe.output_bias import OutputBiasMoE

__all__ = [
    "MIXTRAL_PLAN",
    "QWEN2_MOE_PLAN",
    "LogitsMoE",
    "convert_hf_moe",
    "hf_moe_conversion",
    "hf_moe_state_dict",
    "is_hf_sparse_moe",
    "moe_from_hf",
]

log = logging.getLogger(__name__)


class LogitsMoE(MoE):
    """An `MoE` in the place of an HF block that returns ``(out, router_logits)`` (Llama 4's,
    whose decoder layer unpacks the pair): returns ``(out, None)``, as HF's router logits are not
    kept after conversion (`convert_hf_moe` refuses ``output_router_logits``)."""

    def forward(self, x: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return super().forward(x), None


def is_hf_sparse_moe(module: nn.Module) -> bool:
    """Whether ``module`` is laid out as an HF sparse MoE block (by its attributes, whatever
    its class is called): experts holding their tensors as a ``hf_moe_banks`` layout does
    (``experts.gate_up_proj`` and ``experts.down_proj``, or ``up_proj`` and ``down_proj``, or
    ``mlp.w1`` / ``v1`` / ``w2``), or holding JetMoE's gated ``input_linear`` / ``output_linear``
    itself (`holds_parallel_experts`: not JetMoE's mixture of attention heads), beside a router
    submodule ``gate`` or ``router``. Whether it can be reproduced is `moe_from_hf`'s to say."""
    experts = getattr(module, "experts", None)
    experts = peel(experts) if isinstance(experts, nn.Module) else experts  # PEFT's wrappers
    routers = (getattr(module, "gate", None), getattr(module, "router", None))
    held = holds_bank(experts) or holds_parallel_experts(module)
    return any(isinstance(router, nn.Module) for router in routers) and held


def moe_from_hf(block: nn.Module, *, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0) -> MoE:
    """The `MoE` computing what HF sparse MoE ``block`` computes, with copies of its weights
    (on its device, in its dtype, trained or frozen as they were) and of PEFT's LoRA adapters
    on it (`hf_moe_adapters`); refuses a block it cannot reproduce, naming why."""
    if not is_hf_sparse_moe(block):
        raise ValueError(
            f"{type(block).__name__} is not a Mixtral / Qwen2-MoE sparse MoE block, nor any HF sparse MoE "
            "block (experts.gate_up_proj, experts.down_proj and a gate or router)"
        )
    if is_layer_mixture(block):  # Gemma 4's, inside its decoder layer (hf_gemma4; no PEFT carried)
        if any(is_wrapper(m) for part in mixture_modules(block) for m in part.modules()):
            raise ValueError(
                f"{type(block).__name__}: PEFT adapters on a decoder layer's mixture are not carried"
            )
        return layer_mixture(block, aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef)
    if kept_kind(block) is not None:  # PhiMoE's, ZAYA's: the router kept as written (hf_moe_kept)
        if any(is_wrapper(m) for m in block.modules()):
            raise ValueError(
                f"{type(block).__name__}: PEFT adapters on a block whose router is kept are not carried"
            )
        return kept_layer(block, aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef)
    with peeled(block) as wrapped:  # PEFT's adapters on the block: carried (hf_moe_adapters)
        layer, layout = _read(block, aux_loss_coef, z_loss_coef)
        where = type(block).__name__
        carry(layer, wrapped, router_weight=layout.router_weight, shared=layout.shared, where=where)
    return layer


def _read(block: nn.Module, aux_loss_coef: float, z_loss_coef: float) -> tuple[MoE, HFLayout]:
    layout = read_layout(block)
    bank: Any = bank_module(block, layout.bank)
    if weighs_in_float32(block, bank, layout.d_model):  # Mixtral's fp32 weights (hf_dtypes)
        layout = replace(layout, routing=replace(layout.routing, weights_float32=True))
    ref: Tensor = next(bank.parameters())  # where and in what dtype the bank is held
    if layout.out_bias is not None and layout.returns_logits:
        raise ValueError("a block with an output bias that returns its router's logits is not reproduced")
    table = None if layout.hash_table is None else block_tensor(block, layout.hash_table)
    cls = OutputBiasMoE if layout.out_bias is not None else LogitsMoE if layout.returns_logits else MoE
    # a block without storage (deferred) gives a layer without storage: nothing is drawn
    with torch.device("meta") if ref.is_meta else contextlib.nullcontext():
        layer = cls(
            layout.d_model,
            layout.hidden,
            layout.experts,
            layout.top_k,
            renormalize=layout.renormalize,
            routing=layout.routing,
            weigh=layout.weigh,
            identity_experts=layout.identity_experts,
            post_norm_eps=layout.post_norm_eps,
            activation=layout.activation,
            expert_bias=layout.bank == "interleaved",
            router_bias=layout.router_bias is not None,
            shared_hidden=layout.shared_hidden,
            shared_gate=layout.shared_gate is not None,
            expert_norm_eps=layout.expert_norm_eps,
            shared_experts=layout.shared_experts,
            shared_scores=layout.shared_scores,
            shared_norm_eps=layout.shared_norm_eps,
            router_scale=layout.router_scale is not None,
            hash_vocab=None if table is None else int(table.shape[0]),
            seed=0,
            aux_loss_coef=aux_loss_coef,
            z_loss_coef=z_loss_coef,
        )
    layer = layer.to(device=ref.device, dtype=ref.dtype)
    if layer.shared is not None:  # its own activation (HunYuan-V4's shared expert is not clamped)
        if is_gated(layout.shared_activation) != is_gated(layout.activation):
            raise ValueError(
                f"its shared expert's activation {layout.shared_activation!r} is gated and the experts' "
                f"{layout.activation!r} is not, or the other way round; tessera.moe's banks match"
            )
        layer.shared.activation = layout.shared_activation
    h = layout.hidden
    with torch.no_grad():
        layer.router.weight.copy_(block_tensor(block, layout.router_weight))
        if layout.score_bias is not None:
            held = layer.router.score_bias
            assert held is not None  # RouterSpec(choice_bias=True)
            bias = block_tensor(block, layout.score_bias).detach().reshape(-1)
            if held.is_meta and not bias.is_meta:  # a deferred model's buffer stays real
                layer.router.score_bias = bias.to(held.dtype).clone()
            else:
                held.copy_(bias)
        if table is not None:  # DeepSeek-V4's tid2eid: each token id's experts
            held = layer.router.tid2eid
            assert held is not None  # hash_vocab
            if held.is_meta and not table.is_meta:  # a deferred model's buffer stays real
                layer.router.tid2eid = table.detach().to(held.dtype).clone()
            else:
                held.copy_(table)
        if layout.router_bias is not None:
            assert layer.router.bias is not None
            layer.router.bias.copy_(block_tensor(block, layout.router_bias))
        if layout.bank in PART_LAYOUTS:  # read through the parts that export them
            for w, parts in bank_parts(layout.bank, layout.experts, h, layout.expert_norm).items():
                layer.get_parameter(w).copy_(read_parts(block, parts))
        elif layout.bank == "interleaved":  # gate and up columns alternating, biases
            gate_up, down = bank.gate_up_proj, bank.down_proj
            experts = layer.experts
            assert experts.w3 is not None  # SwiGLU
            assert experts.b1 is not None and experts.b2 is not None and experts.b3 is not None
            experts.w1.copy_(gate_up[..., 0::2])
            experts.w3.copy_(gate_up[..., 1::2])
            experts.w2.copy_(down)
            experts.b1.copy_(bank.gate_up_proj_bias[..., 0::2])
            experts.b3.copy_(bank.gate_up_proj_bias[..., 1::2])
            experts.b2.copy_(bank.down_proj_bias)
        elif layout.columns:
            gate_up, down = bank.gate_up_proj, bank.down_proj  # [E, d, 2h], [E, h, d]
            assert layer.experts.w3 is not None  # SwiGLU
            layer.experts.w1.copy_(gate_up[:, :, :h])
            layer.experts.w3.copy_(gate_up[:, :, h:])
            layer.experts.w2.copy_(down)
        else:
            gate_up, down = bank.gate_up_proj, bank.down_proj  # [E, 2h, d], [E, d, h]
            assert layer.experts.w3 is not None  # SwiGLU
            layer.experts.w1.copy_(gate_up[:, :h].transpose(1, 2))
            layer.experts.w3.copy_(gate_up[:, h:].transpose(1, 2))
            layer.experts.w2.copy_(down.transpose(1, 2))
        if layout.shared is not None:
            shared: Any = block.get_submodule(layout.shared)
            assert layer.shared is not None
            for w, proj, band in layout.shared_projections:  # nn.Linear s, or stacked [S, out, in]
                held = getattr(shared, proj)
                weight = held if layout.shared_stacked else held.weight[None]
                weight = weight if band is None else band.cut(weight)  # MiniMax-M3's gate | up rows
                getattr(layer.shared, w).copy_(weight.transpose(-2, -1))
        for ours, theirs, index in renamed_tensors(layout):  # Ergo's shared norm, Inkling's global scale
            value = block_tensor(block, theirs)
            layer.get_parameter(ours).copy_(value if index is None else value[None])
        if layout.shared_gate is not None:
            assert layer.shared_gate is not None
            layer.shared_gate.copy_(block_tensor(block, f"{layout.shared_gate}.weight"))
        if layout.post_norm is not None:
            assert layer.post_norm is not None
            layer.post_norm.copy_(block_tensor(block, f"{layout.post_norm}.weight"))
        if layout.out_bias is not None:
            assert isinstance(layer, OutputBiasMoE)
            layer.bias.copy_(block_tensor(block, layout.out_bias))
    _keep_frozen(layer, block, layout)
    return layer, layout


def _keep_frozen(layer: MoE, block: nn.Module, layout: HFLayout) -> None:
    """The converted weights trained or frozen as the block's were (a PEFT model freezes them)."""
    bank: Any = bank_module(block, layout.bank)
    layer.router.weight.requires_grad_(block_tensor(block, layout.router_weight).requires_grad)
    if layout.bank in PART_LAYOUTS:
        for w, parts in bank_parts(layout.bank, layout.experts, layout.hidden, layout.expert_norm).items():
            layer.get_parameter(w).requires_grad_(block.get_parameter(parts[0].name).requires_grad)
    else:
        for w, source in (("w1", bank.gate_up_proj), ("w3", bank.gate_up_proj), ("w2", bank.down_proj)):
            getattr(layer.experts, w).requires_grad_(source.requires_grad)
    if layout.bank == "interleaved":
        for b, hf in (("b1", "gate_up_proj_bias"), ("b3", "gate_up_proj_bias"), ("b2", "down_proj_bias")):
            getattr(layer.experts, b).requires_grad_(getattr(bank, hf).requires_grad)
    if layout.router_bias is not None and layer.router.bias is not None:
        layer.router.bias.requires_grad_(block_tensor(block, layout.router_bias).requires_grad)
    if layout.shared is not None and layer.shared is not None:
        shared: Any = block.get_submodule(layout.shared)
        for w, hf, _ in layout.shared_projections:
            source = getattr(shared, hf) if layout.shared_stacked else getattr(shared, hf).weight
            getattr(layer.shared, w).requires_grad_(source.requires_grad)
    for ours, theirs, _ in renamed_tensors(layout):
        layer.get_parameter(ours).requires_grad_(block_tensor(block, theirs).requires_grad)
    if layout.shared_gate is not None and layer.shared_gate is not None:
        layer.shared_gate.requires_grad_(block_tensor(block, f"{layout.shared_gate}.weight").requires_grad)
    if layout.post_norm is not None and layer.post_norm is not None:
        layer.post_norm.requires_grad_(block_tensor(block, f"{layout.post_norm}.weight").requires_grad)
    if layout.out_bias is not None and isinstance(layer, OutputBiasMoE):
        layer.bias.requires_grad_(block_tensor(block, layout.out_bias).requires_grad)


def convert_hf_moe(model: nn.Module, *, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0) -> int:
    """Replace every HF sparse MoE block of ``model`` by its `moe_from_hf` layer, in place,
    under the same name (so plans and checkpoints see ``...mlp.router.weight``,
    ``...mlp.experts.w1``, ...). Returns how many. Refuses, changing nothing, a model with a
    block it cannot reproduce, or asking for HF's router logits (``output_router_logits``: the
    converted layers do not record them)."""
    _check_router_logits(model)
    found = [(n, m) for n, m in model.named_modules() if n and is_hf_sparse_moe(m)]
    layers = []
    for name, block in found:
        try:
            layers.append(moe_from_hf(block, aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef))
        except ValueError as exc:
            raise ValueError(f"{type(model).__name__}.{name}: {exc}") from exc
    _swap(model, [name for name, _ in found], layers)
    log.debug("converted %d sparse MoE blocks of %s", len(found), type(model).__name__)
    return len(found)


def _check_router_logits(model: nn.Module) -> None:
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise ValueError(
            "config.output_router_logits=True: HF's router loss is not kept after conversion; set it "
            "False and pass aux_loss_coef / z_loss_coef for the layers' own losses"
        )


def _swap(model: nn.Module, names: list[str], layers: list[MoE]) -> None:
    for name, layer in zip(names, layers, strict=True):
        if is_layer_mixture(model.get_submodule(name)):  # Gemma 4's: the layer holds it (hf_gemma4)
            attach(model.get_submodule(name), layer)
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)


def hf_moe_conversion(model: nn.Module, groups: Mapping[str, int] | None = None) -> Conversion:
    """What ``boost()`` does with ``model``'s HF sparse MoE blocks: each replaced, in place, by
    its `moe_from_hf` layer (no router losses of its own, as HF trains without
    ``output_router_logits``), and the `Conversion` that keeps transformers' names: ``exported``
    maps each new parameter to the HF tensor it is part of (`hf_moe_export`; a score-correction
    bias, a buffer, to its HF name) and ``groups`` each new trained parameter to the optimizer
    group of that HF tensor (by ``groups``, the current names'). Refuses (ValueError naming the
    block), changing nothing, what `convert_hf_moe` refuses, a block carrying PEFT adapters
    (`convert_hf_moe` converts those, by hand, before ``boost()``), and, on a deferred model, a
    block whose score-correction bias is a parameter without storage (the converted router
    holds a buffer, which deferred initialization does not make)."""
    _check_router_logits(model)
    merges = expert_merges(model)  # the banks its checkpoints hold per expert
    conversion = Conversion()
    layers, names = [], []
    for name, block in [(n, m) for n, m in model.named_modules() if n and is_hf_sparse_moe(m)]:
        where = f"{type(model).__name__}.{name}"
        inside = is_layer_mixture(block)  # Gemma 4's: only its mixture's modules count
        if any(
            is_wrapper(m) for part in (mixture_modules(block) if inside else [block]) for m in part.modules()
        ):
            advice = (
                "adapters on its mixture (router, experts, the two norms) are not carried"
                if inside
                else "call convert_hf_moe(model) before boost()"
            )
            raise ValueError(
                f"{where} ({type(block).__name__}) carries PEFT adapters, which boost() does not convert "
                f"with transformers' names: {advice}"
            )
        names.append(name)
        if is_layer_mixture(block):  # Gemma 4's: held by its decoder layer as `moe` (hf_gemma4)
            try:
                layer = layer_mixture(block)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from exc
            held = f"{name}.{HOLDER}"
            exported = mixture_parts(name, block, merges)
            _record(conversion, held, layer, exported, groups)
            layers.append(layer)
            continue
        if kept_kind(block) is not None:  # PhiMoE's, ZAYA's: the router kept as written (hf_moe_kept)
            try:
                layer = kept_layer(block)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from exc
            _record(conversion, name, layer, mixture_parts(name, block, merges), groups)
            layers.append(layer)
            continue
        try:
            layer, layout = _read(block, 0.0, 0.0)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        for buffer in (layout.score_bias, layout.hash_table):
            if buffer is not None and block_tensor(block, buffer).is_meta:
                raise ValueError(
                    f"{where}.{buffer} is a tensor without storage (a deferred model): the converted "
                    "router holds it as a buffer, which deferred initialization does not make; build the "
                    "model with its weights"
                )
        exported = mixture_parts(name, block, merges, layout)
        _record(conversion, name, layer, exported, groups)
        layers.append(layer)
    _swap(model, names, layers)
    if layers:
        log.info("converted %d HF sparse MoE blocks to tessera.moe.MoE: %s", len(layers), conversion.blocks)
    return conversion


def _record(
    conversion: Conversion,
    name: str,
    layer: MoE,
    exported: dict[str, tuple[ExportPart, ...]],
    groups: Mapping[str, int] | None,
) -> None:
    """Add the layer converted to be ``name`` to ``conversion``: its export parts, and the
    optimizer group of each trained tensor by its HF tensor's (``groups``, the current names')."""
    assert {f"{name}.{n}" for n, _ in layer.named_parameters()} <= set(exported)
    conversion.exported.update(exported)
    if groups is not None:
        trained = (f"{name}.{n}" for n, p in layer.named_parameters() if p.requires_grad)
        conversion.groups.update(
            {n: groups[exported[n][0].name] for n in trained if exported[n][0].name in groups}
        )
    conversion.blocks.append(name)
