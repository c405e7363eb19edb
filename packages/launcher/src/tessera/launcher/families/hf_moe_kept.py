"""Hugging Face sparse MoE blocks whose router is kept as transformers wrote it
(``tessera.moe.kept_router.KeptRouter``): PhiMoE's sparsemixer and ZAYA's MLP router.

Every HF experts bank computes ``experts(hidden, top_k_index, top_k_weights)``; what
``tessera.moe``'s `RouterSpec` cannot say for these families is only the router. Their block
becomes an `MoE` whose experts are converted as any block's (``experts.w1`` / ``w3`` / ``w2``
from ``experts.gate_up_proj`` and ``down_proj``, split by ep and tp, exported under
transformers' names) and whose router is a copy of the block's router module, called as the
block calls it (a `KeptKind`'s adapter), under ``router.module`` (exported back to the block's
``router.*`` / ``gate.*`` tensors as they are).

- PhiMoE (``PhimoeSparseMoeBlock``): its router samples each of its 2 experts in training
  (Gumbel, among those within ``router_jitter_noise`` of the best) and trains through its own
  backward (``PhimoeMultiplier``); called as the block calls it, it draws from the global
  generator in the block's order and shapes, so the converted model trains as transformers' does
  under the same seed. Its ``input_jitter_noise`` (Phi-3.5-MoE's 0.01) scales the block's input
  by a uniform draw in ``[1 - noise, 1 + noise]`` in training, and the router scales it again, in
  place, so that router and experts both read the twice-scaled tokens: the converted layer draws
  the same and hands its experts those tokens (`KeptChoice.inputs`). Sampling and jitter make
  training random like dropout (``KeptRouter.sampling`` names them; ``boost(verify=True)``
  refuses them, as dropout); with both 0 the sample is forced (the best expert, then the next)
  and the run is deterministic.
- ZAYA (``ZayaSparseMoeBlock``): its router (``gate``: ``down_proj``, a state carried from the
  previous layer's router scaled by ``router_states_scale``, an MLP, a softmax biased by the
  ``balancing_biases`` buffer for the choice) may choose a skip expert (index ``E``), which it
  maps itself to expert 0 with weight 0, as the converted layer then runs it (its share is 0).
  The block's ``(hidden, prev_router_hidden_states) -> (out, next_state)`` is kept
  (`CarriedMoE`). Under sequence parallelism (each tp rank a slice of the sequence inside the
  layer) it is refused: its state is per token of the whole sequence.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from tessera.launcher.checkpoint.exported import ExportPart
from tessera.launcher.checkpoint.placement import persistent_buffers
from tessera.launcher.families.hf_moe_banks import bank_module, bank_parts, read_bank
from tessera.launcher.families.hf_moe_kinds import source_key
from tessera.launcher.families.hf_names import per_expert
from tessera.moe import MoE
from tessera.moe.kept_router import Adapter, KeptChoice, KeptRouter

__all__ = ["KEPT_KINDS", "CarriedMoE", "KeptKind", "kept_kind", "kept_layer", "kept_parts"]

log = logging.getLogger(__name__)

HELD = "router.module"  # where the converted layer holds the kept router's tensors


@dataclass(frozen=True, slots=True)
class KeptKind:
    """A block whose router is kept: its ``forward`` read from ``transformers.models.<like>`` and
    recognised by ``key``, its router ``block.<router>`` (whose forward has key ``router_key``),
    called by ``adapter(block)``; ``sampling(block)``: what makes it random in training ("" when
    nothing does); ``check(block)``: what of this instance cannot be kept ("" when all can);
    ``carries``: the block takes and returns a state for the next layer's router."""

    name: str
    like: str
    key: str
    router: str
    router_key: str
    adapter: Callable[[Any], Adapter]
    sampling: Callable[[Any], str]
    check: Callable[[Any], str]
    carries: bool = False


def _phimoe(block: Any) -> Adapter:
    """PhiMoE's block: its input scaled by its ``input_jitter_noise`` in training (as the block
    does, in place there: its input is the norm's fresh output), then the router on the flat
    tokens, ``(logits, weights, experts)``; the router scales them again in place where its own
    jitter is on (on a copy here), and the experts read what it leaves (module docstring)."""
    noise = float(block.input_jitter_noise)

    def call(module: nn.Module, x: Tensor, carried: Tensor | None) -> KeptChoice:
        jittered = module.training and noise > 0
        if jittered:
            x = x * torch.empty_like(x).uniform_(1.0 - noise, 1.0 + noise)
        flat = x.reshape(-1, x.shape[-1])
        scales = module.training and float(module.input_jitter_noise) > 0  # type: ignore[arg-type]
        flat = flat.clone() if scales else flat  # the router scales it in place
        logits, weights, choices = module(flat)
        return KeptChoice(choices, weights, logits, inputs=flat if jittered or scales else None)

    return call


def _phimoe_sampling(block: Any) -> str:
    noises = {
        "router_jitter_noise": float(block.router.router_jitter_noise),
        "input_jitter_noise": max(float(block.input_jitter_noise), float(block.router.input_jitter_noise)),
    }
    on = [f"{name}={value}" for name, value in noises.items() if value > 0]
    why = "PhiMoE's sparsemixer samples its experts, its input is jittered"
    return f"{' and '.join(on)} ({why})" if on else ""


def _phimoe_check(block: Any) -> str:
    top_k = int(block.router.top_k)
    return f"top_k={top_k}: the sparsemixer chooses 2 experts" if top_k != 2 else ""


def _zaya_call(module: nn.Module, x: Tensor, carried: Tensor | None) -> KeptChoice:
    """ZAYA's block: the router on ``[batch, seq, d]`` with the previous layer's state."""
    if x.dim() != 3:
        raise ValueError(f"ZAYA's router reads [batch, seq, d], got {tuple(x.shape)}")
    logits, weights, choices, state = module(x, router_states=carried)
    return KeptChoice(choices, weights, logits, state)


def _zaya_check(block: Any) -> str:
    gate = block.gate
    if int(gate.num_router_classes) != int(gate.num_experts) + 1:
        return (
            f"its router scores {gate.num_router_classes} classes, not {gate.num_experts} experts and a skip"
        )
    return ""


KEPT_KINDS: tuple[KeptKind, ...] = (
    KeptKind(
        "sparsemixer, kept",
        "phimoe.PhimoeSparseMoeBlock",
        "ed9f2a1a1f64bc16",
        "router",
        "d728119ac0107b87",
        _phimoe,
        _phimoe_sampling,
        _phimoe_check,
    ),
    KeptKind(
        "router state and skip expert, kept",
        "zaya.ZayaSparseMoeBlock",
        "fd7051b4af6a7de1",
        "gate",
        "6526681b3bf5ee18",
        lambda block: _zaya_call,
        lambda block: "",
        _zaya_check,
        carries=True,
    ),
)


def kept_kind(block: nn.Module) -> KeptKind | None:
    """The `KeptKind` reading ``block`` (by its forward's source key), or None."""
    key = source_key(type(block).forward)
    return next((k for k in KEPT_KINDS if k.key == key), None)


class CarriedMoE(MoE):
    """An `MoE` in the place of a block that carries its router's state between layers (ZAYA's):
    ``forward(x, state) -> (out, next_state)``, the states those of its kept router
    (`MoE.forward_routed`'s ``carried`` and `Routing.carried`)."""

    def forward(  # type: ignore[override]
        self, x: Tensor, state: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        router = self.router
        if not isinstance(router, KeptRouter):
            raise ValueError(f"a CarriedMoE needs a KeptRouter, got {type(router).__name__}")
        if self.gathers:
            raise ValueError(
                f"{type(router.module).__name__} carries a state per token of the whole sequence to the next "
                f"layer, but this layer's input is gathered ({len(self.gathers)} gathers: sequence "
                "parallelism or 2D / 2.5D / 3D tp): refused; train it in 1D tp without sequence parallelism"
            )
        out, routing = self.forward_routed(x, carried=state)
        return out, routing.carried


def kept_layer(block: nn.Module, *, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0) -> MoE:
    """The `MoE` computing what ``block`` (of a `KeptKind`) computes: its experts converted, a
    copy of its router kept (module docstring); ValueError naming what cannot be."""
    kind = kept_kind(block)
    name = type(block).__name__
    if kind is None:
        raise ValueError(f"{name}: not a block whose router is kept (hf_moe_kept.KEPT_KINDS)")
    router: Any = getattr(block, kind.router)
    found_key = source_key(type(router).forward)
    if kind.router_key and found_key != kind.router_key:
        raise ValueError(
            f"{name}: its router {type(router).__name__} has a forward tessera.moe has no reading of "
            f"(source key {found_key})"
        )
    problem = kind.check(block)
    if problem:
        raise ValueError(f"{name}: {problem}")
    bank = read_bank(bank_module(block, "rows"), "rows")
    top_k = int(router.top_k)
    gate_up: Tensor = block.get_parameter("experts.gate_up_proj")
    down: Tensor = block.get_parameter("experts.down_proj")
    cls = CarriedMoE if kind.carries else MoE
    # a block without storage (deferred) gives a layer without storage: nothing is drawn
    with torch.device("meta") if gate_up.is_meta else contextlib.nullcontext():
        layer = cls(
            bank.d_model,
            bank.hidden,
            bank.experts,
            top_k,
            activation=bank.activation,
            seed=0,
            aux_loss_coef=aux_loss_coef,
            z_loss_coef=z_loss_coef,
        )
    layer = layer.to(device=gate_up.device, dtype=gate_up.dtype)
    h = bank.hidden
    with torch.no_grad():
        assert layer.experts.w3 is not None  # SwiGLU
        layer.experts.w1.copy_(gate_up[:, :h].transpose(1, 2))
        layer.experts.w3.copy_(gate_up[:, h:].transpose(1, 2))
        layer.experts.w2.copy_(down.transpose(1, 2))
    for w, source in (("w1", gate_up), ("w3", gate_up), ("w2", down)):
        getattr(layer.experts, w).requires_grad_(source.requires_grad)
    kept = KeptRouter(
        copy.deepcopy(router), kind.adapter(block), bank.experts, top_k, sampling=kind.sampling(block)
    )
    layer.router = kept  # type: ignore[assignment]  # a router kept as written (tessera.moe.kept_router)
    log.debug("%s: experts converted, router %s kept", name, type(router).__name__)
    return layer


def kept_parts(
    name: str, block: nn.Module, merges: Mapping[str, tuple[str, ...]] | None = None
) -> dict[str, tuple[ExportPart, ...]]:
    """The converted layer's tensors (by their names in the model; ``name`` the block's) as parts
    of the block's: the experts' bands of ``experts.gate_up_proj`` and ``experts.down_proj`` (as
    `hf_moe_banks.bank_parts` lays out any rows bank), the kept router's every parameter and
    persistent buffer the block's router's of the same name; with the per-expert tensors of
    ``merges`` as older parts."""
    kind = kept_kind(block)
    if kind is None:
        raise ValueError(f"{type(block).__name__}: not a block whose router is kept")
    bank = read_bank(bank_module(block, "rows"), "rows")
    out = {  # Mixtral's rows: gate_up [E, 2h, d], down [E, d, h]
        f"{name}.{w}": tuple(replace(p, name=f"{name}.{p.name}") for p in parts)
        for w, parts in bank_parts("rows", bank.experts, bank.hidden).items()
    }
    if merges:
        out = per_expert(out, merges, bank.experts)
    router: nn.Module = getattr(block, kind.router)
    tensors = [n for n, _ in router.named_parameters()] + list(persistent_buffers(router))
    for rel in tensors:
        out[f"{name}.{HELD}.{rel}"] = (ExportPart(f"{name}.{kind.router}.{rel}"),)
    return out
