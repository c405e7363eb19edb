"""Gemma 4's mixture of experts (``enable_moe_block``), which has no block of its own: its decoder
layer holds the router and the experts beside its dense MLP, and `is_layer_mixture` recognises
such a layer by the source of its ``forward`` (`LAYER`).

What the layer computes, from the residual ``r`` entering its feed-forward half: its router
(`ROUTER`) reads ``r`` through an RMS norm without weight, times a trained ``router.scale [d]``
and ``hidden_size**-0.5``, scores the experts with ``router.proj`` (softmax, top-k,
renormalised) and multiplies each chosen weight by a trained ``router.per_expert_scale [E]``;
its experts (Mixtral's bank, ``experts.gate_up_proj [E, 2h, d]`` and ``experts.down_proj [E, d,
h]``, with the tanh GELU: ``gelu_pytorch_tanh``) read ``pre_feedforward_layernorm_2(r)``; their
weighted sum passes ``post_feedforward_layernorm_2`` (`NORM`: weight times the RMS-normalised
input, in fp32) and is added to ``post_feedforward_layernorm_1`` of the dense MLP's output.
That is one ``tessera.moe.MoE`` (`layer_mixture`): ``router_norm_eps``, ``router_input_multiplier``
and ``router_expert_scale``, ``input_norm_eps`` for the experts' own input, ``post_norm_eps`` for
the output, the ``"geglu_tanh"`` activation.

`attach` moves the mixture into the layer as its ``moe`` attribute (the router, the experts and
the two norms it takes over removed) and gives the layer the class `mixed_class` makes, whose
``forward`` is the one `LAYER` hashes, with ``self.moe(r)`` in the place of those four modules:
a new transformers whose layer computes otherwise is not recognised, and its layer is refused
by ``hf_moe_routing.read_layout``, naming the key. `layer_parts` names each tensor of the
mixture as the part of transformers' tensor it came from (for ``boost()``'s exports,
``consolidate`` and ``import_weights``, and ``hf_moe_export.hf_moe_state_dict``'s way back).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from tessera.launcher.checkpoint.exported import ExportPart
from tessera.launcher.families.hf_moe_banks import bank_key, bank_parts
from tessera.launcher.families.hf_moe_kinds import EXPERTS, source_key
from tessera.moe import MoE

__all__ = [
    "HOLDER",
    "LAYER",
    "NORM",
    "ROUTER",
    "attach",
    "is_layer_mixture",
    "layer_mixture",
    "layer_parts",
    "mixed_class",
    "mixture_modules",
]

LAYER = ("gemma4.Gemma4TextDecoderLayer", "eb7d5248b61c335c")  # the decoder layer's forward
ROUTER = ("gemma4.Gemma4TextRouter", "f40272512255ad1a")
NORM = ("gemma4.Gemma4RMSNorm", "d1940ebc2a817f5e")  # (weight *) x * (mean(x^2) + eps)^-0.5, fp32
HOLDER = "moe"  # the layer's attribute holding the converted mixture
_TAKEN = ("router", "experts", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")
# the converted mixture's tensors -> transformers' (relative to the layer), the bank's apart
_RENAMED = {
    "router.weight": "router.proj.weight",
    "router.input_scale": "router.scale",
    "router.expert_scale": "router.per_expert_scale",
    "input_norm": "pre_feedforward_layernorm_2.weight",
    "post_norm": "post_feedforward_layernorm_2.weight",
}


def is_layer_mixture(module: nn.Module) -> bool:
    """Whether ``module`` is a decoder layer holding its mixture as Gemma 4's does (its forward
    `LAYER`'s, its mixture enabled)."""
    return bool(getattr(module, "enable_moe_block", False)) and source_key(type(module).forward) == LAYER[1]


def mixture_modules(layer: nn.Module) -> list[nn.Module]:
    """The modules of ``layer`` (`is_layer_mixture`) its mixture is made of: router, experts and
    the two norms the converted `MoE` computes (PEFT adapters elsewhere in the layer, on its
    attention or dense MLP, are no part of it)."""
    return [layer.get_submodule(name) for name in _TAKEN]


def _norm_eps(layer: Any, name: str, weighted: bool) -> float:
    norm = layer.get_submodule(name)
    if source_key(type(norm).forward) != NORM[1] or bool(norm.with_scale) != weighted:
        raise ValueError(
            f"its {name} ({type(norm).__name__}) does not compute what {NORM[0]} "
            f"{'with' if weighted else 'without'} a weight does"
        )
    return float(norm.variance_epsilon)


def _read(layer: Any) -> dict[str, Any]:
    """``layer``'s mixture as `MoE`'s arguments; ValueError naming what is not reproduced."""
    router, bank = layer.router, layer.experts
    if source_key(type(router).forward) != ROUTER[1]:
        raise ValueError(f"its router {type(router).__name__} does not compute what {ROUTER[0]} does")
    if bank_key(type(bank)) != f"{EXPERTS[1]}+fe7a0279de333525":
        raise ValueError(f"its experts {type(bank).__name__} do not compute what {EXPERTS[0]} computes")
    if type(bank.act_fn).__name__ != "GELUTanh":
        raise ValueError(
            f"its experts' activation {type(bank.act_fn).__name__} is not the tanh GELU (GELUTanh)"
        )
    if router.proj.bias is not None:
        raise ValueError("its router's proj has a bias; tessera.moe's router has none")
    experts, two_h, d = bank.gate_up_proj.shape
    if tuple(router.proj.weight.shape) != (experts, d):
        raise ValueError(f"its router scores {tuple(router.proj.weight.shape)}, not its {experts} experts")
    return {
        "d_model": int(d),
        "hidden": int(two_h) // 2,
        "experts": int(experts),
        "top_k": int(router.config.top_k_experts),
        "activation": "geglu_tanh",
        "router_norm_eps": _norm_eps(router, "norm", False),
        "router_input_multiplier": float(router.scalar_root_size),
        "router_expert_scale": True,
        "input_norm_eps": _norm_eps(layer, "pre_feedforward_layernorm_2", True),
        "post_norm_eps": _norm_eps(layer, "post_feedforward_layernorm_2", True),
    }


def layer_mixture(layer: nn.Module, *, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0) -> MoE:
    """The `MoE` computing ``layer``'s mixture (module docstring) with copies of its weights (on
    its device, in its dtype, trained or frozen as they were); refuses, naming why, what it
    cannot reproduce."""
    try:
        args = _read(layer)
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"not the layout {LAYER[0]} holds ({type(exc).__name__}: {exc})") from exc
    ref = layer.get_parameter("experts.gate_up_proj")
    with torch.device("meta") if ref.is_meta else contextlib.nullcontext():
        moe = MoE(**args, seed=0, aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef)
    moe = moe.to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        for ours, parts in layer_parts("", args["hidden"]).items():
            (part,) = parts
            theirs = layer.get_parameter(part.name.removeprefix("."))
            value = theirs if part.band is None else part.band.cut(theirs)
            target = moe.get_parameter(ours.removeprefix(f".{HOLDER}."))
            target.copy_(value.transpose(-2, -1) if part.transpose else value)
            target.requires_grad_(theirs.requires_grad)
    return moe


def layer_parts(name: str, hidden: int) -> dict[str, tuple[ExportPart, ...]]:
    """Each tensor of the mixture held by layer ``name`` (``<name>.moe.<tensor>``) as the part of
    transformers' tensor of the layer it is: the experts' as any bank of Mixtral's rows layout
    (`hf_moe_banks.bank_parts`: ``w1`` / ``w3`` the gate / up rows of ``experts.gate_up_proj``
    transposed, ``w2`` ``experts.down_proj`` transposed), the router's and the norms' tensors as
    they are (`_RENAMED`)."""
    out: dict[str, tuple[ExportPart, ...]] = {
        f"{name}.{HOLDER}.{ours}": (ExportPart(f"{name}.{theirs}"),) for ours, theirs in _RENAMED.items()
    }
    for tensor, parts in bank_parts("rows", 0, hidden).items():  # (the rows layout reads no count)
        out[f"{name}.{HOLDER}.{tensor}"] = tuple(replace(p, name=f"{name}.{p.name}") for p in parts)
    return out


def _forward(
    self: Any,
    hidden_states: Tensor,
    per_layer_input: Tensor | None = None,
    shared_kv_states: Any = None,
    position_embeddings: Any = None,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> Tensor:
    """`LAYER`'s forward with its mixture computed by ``self.moe`` (module docstring)."""
    if cache is None:  # the older name transformers still takes for it
        cache = kwargs.pop("past_key_values", None)
    attended, _ = self.self_attn(
        hidden_states=self.input_layernorm(hidden_states),
        position_embeddings=position_embeddings,
        attention_mask=attention_mask,
        shared_kv_states=shared_kv_states,
        position_ids=position_ids,
        cache=cache,
        **kwargs,
    )
    residual = hidden_states + self.post_attention_layernorm(attended)
    dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(residual)))
    out = residual + self.post_feedforward_layernorm(dense + getattr(self, HOLDER)(residual))
    if self.hidden_size_per_layer_input:
        gated = self.act_fn(self.per_layer_input_gate(out)) * per_layer_input
        out = out + self.post_per_layer_input_norm(self.per_layer_projection(gated))
    scaled: Tensor = out * self.layer_scalar
    return scaled


_MIXED: dict[type, type] = {}


def mixed_class(cls: type) -> type:
    """The subclass of decoder layer class ``cls`` whose forward calls its ``moe`` (one per class)."""
    if cls not in _MIXED:
        _MIXED[cls] = type(f"{cls.__name__}WithMoE", (cls,), {"forward": _forward, "__module__": __name__})
    return _MIXED[cls]


def attach(layer: nn.Module, moe: MoE) -> None:
    """Give ``layer`` (`is_layer_mixture`) the mixture ``moe`` as its ``moe``, in place of the
    router, experts and the two norms ``moe`` computes, and the class of `mixed_class`."""
    if not is_layer_mixture(layer):
        raise ValueError(f"{type(layer).__name__} is not a decoder layer holding its mixture as {LAYER[0]}")
    for name in _TAKEN:
        delattr(layer, name)
    layer.add_module(HOLDER, moe)
    layer.__class__ = mixed_class(type(layer))
