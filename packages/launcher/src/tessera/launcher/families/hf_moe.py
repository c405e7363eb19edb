"""Hugging Face Mixtral and Qwen2-MoE: their sparse MoE blocks as ``tessera.moe.MoE`` layers,
and the plans of roles that leave experts whole under tensor parallelism.

``transformers``' ``MixtralSparseMoeBlock`` and ``Qwen2MoeSparseMoeBlock`` hold a router
``gate.weight [E, d]`` (softmax in fp32, top-k; Mixtral renormalises the k weights, Qwen2-MoE
when ``norm_topk_prob``) and experts ``experts.gate_up_proj [E, 2h, d]`` (gate rows, then
up rows) and ``experts.down_proj [E, d, h]`` computing ``down(silu(gate x) * up x)``;
Qwen2-MoE adds a shared SwiGLU expert scaled per token by ``sigmoid(shared_expert_gate x)``.
`moe_from_hf` builds the `MoE` computing the same function with the same weights
(``w1 = gate.T``, ``w3 = up.T``, ``w2 = down.T`` per expert; drop-less, as HF routes every
token), and `convert_hf_moe` swaps every such block of a model for one, in place, so that
``boost()`` trains it and ``parallel.ep`` can split its experts. HF's own router loss (from
``output_router_logits``) is not kept: pass ``aux_loss_coef`` / ``z_loss_coef`` to train the
routers with the layer's own losses (`tessera.moe.aux`). `hf_moe_state_dict` maps a
converted model's weights (what ``consolidate`` writes) back to transformers' names.

`MIXTRAL_PLAN` and `QWEN2_MOE_PLAN` are `LLAMA_PLAN`'s attention, norms, embedding and head
with each layer's ``mlp`` replicated (``Roles.REPLICATE``): under tensor parallelism every tp
rank runs the whole mixture on the same tokens, so no expert is cut; a dense Qwen2-MoE layer
(``mlp_only_layers``, ``decoder_sparse_step``) is replicated too. They refuse sequence
parallelism (a replicated mixture would see each rank's slice of the sequence). A converted
Mixtral whose plan gives ``model.layers.*.mlp`` the ``moe`` style (`moe_style`) has every
expert split over tp instead, and takes sequence parallelism.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from tessera.moe import MoE
from tessera.tensor_parallel import LLAMA_PLAN, Plan
from tessera.tensor_parallel.roles import Roles

__all__ = [
    "MIXTRAL_PLAN",
    "QWEN2_MOE_PLAN",
    "convert_hf_moe",
    "hf_moe_state_dict",
    "is_hf_sparse_moe",
    "moe_from_hf",
]

log = logging.getLogger(__name__)


def _plan(name: str) -> Plan:
    entries = {p: s for p, s in LLAMA_PLAN.as_dict().items() if not p.startswith("model.layers.*.mlp")}
    return Plan.of(
        {**entries, "model.layers.*.mlp": Roles.REPLICATE}, name=name, supports_sequence_parallel=False
    )


def is_hf_sparse_moe(module: nn.Module) -> bool:
    """Whether ``module`` is laid out as HF's Mixtral / Qwen2-MoE sparse block (by its
    attributes, whatever its class is called)."""
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (
        isinstance(getattr(gate, "weight", None), Tensor)
        and isinstance(getattr(experts, "gate_up_proj", None), Tensor)
        and isinstance(getattr(experts, "down_proj", None), Tensor)
    )


def _silu(act: Any, where: str) -> None:
    if not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLUActivation", "SiLU"):
        raise ValueError(
            f"{where}: activation {type(act).__name__} is not SiLU; tessera.moe's SwiGLU needs SiLU"
        )


def moe_from_hf(block: nn.Module, *, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0) -> MoE:
    """The `MoE` computing what HF sparse MoE ``block`` computes, with copies of its weights
    (on its device, in its dtype); refuses a block it cannot reproduce, naming why."""
    if not is_hf_sparse_moe(block):
        raise ValueError(f"{type(block).__name__} is not a Mixtral / Qwen2-MoE sparse MoE block")
    gate: Any = block.gate
    bank: Any = block.experts
    name = type(block).__name__
    if float(getattr(block, "jitter_noise", 0.0) or 0.0) > 0:
        raise ValueError(f"{name}: router_jitter_noise={block.jitter_noise} is not reproduced; use 0")
    _silu(bank.act_fn, name)
    gate_up, down = bank.gate_up_proj, bank.down_proj  # [E, 2h, d], [E, d, h]
    experts, d, hidden = gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2
    shared: Any = getattr(block, "shared_expert", None)
    if shared is not None:
        _silu(shared.act_fn, f"{name}.shared_expert")
    layer = MoE(
        d,
        hidden,
        experts,
        int(gate.top_k),
        renormalize=bool(getattr(gate, "norm_topk_prob", True)),
        shared_hidden=None if shared is None else int(shared.gate_proj.weight.shape[0]),
        shared_gate=getattr(block, "shared_expert_gate", None) is not None,
        seed=0,
        aux_loss_coef=aux_loss_coef,
        z_loss_coef=z_loss_coef,
    ).to(device=gate_up.device, dtype=gate_up.dtype)
    with torch.no_grad():
        layer.router.weight.copy_(gate.weight)
        layer.experts.w1.copy_(gate_up[:, :hidden].transpose(1, 2))
        assert layer.experts.w3 is not None  # SwiGLU
        layer.experts.w3.copy_(gate_up[:, hidden:].transpose(1, 2))
        layer.experts.w2.copy_(down.transpose(1, 2))
        if shared is not None:
            assert layer.shared is not None and layer.shared.w3 is not None
            layer.shared.w1.copy_(shared.gate_proj.weight.t().unsqueeze(0))
            layer.shared.w3.copy_(shared.up_proj.weight.t().unsqueeze(0))
            layer.shared.w2.copy_(shared.down_proj.weight.t().unsqueeze(0))
        if layer.shared_gate is not None:
            gate_weight: Any = getattr(block, "shared_expert_gate").weight  # noqa: B009  # an HF module
            layer.shared_gate.copy_(gate_weight)
    return layer


def convert_hf_moe(model: nn.Module, *, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0) -> int:
    """Replace every HF sparse MoE block of ``model`` by its `moe_from_hf` layer, in place,
    under the same name (so plans and checkpoints see ``...mlp.router.weight``,
    ``...mlp.experts.w1``, ...). Returns how many; refuses a model asking for HF's router
    logits (``output_router_logits``: the converted layers do not record them)."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            "config.output_router_logits=True: HF's router loss is not kept after conversion; set it "
            "False and pass aux_loss_coef / z_loss_coef for the layers' own losses"
        )
    found = [(n, m) for n, m in model.named_modules() if n and is_hf_sparse_moe(m)]
    for name, block in found:
        parent, _, child = name.rpartition(".")
        setattr(
            model.get_submodule(parent),
            child,
            moe_from_hf(block, aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef),
        )
    log.debug("converted %d sparse MoE blocks of %s", len(found), type(model).__name__)
    return len(found)


MIXTRAL_PLAN = _plan("hf-mixtral")
QWEN2_MOE_PLAN = _plan("hf-qwen2-moe")


def hf_moe_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A converted model's state dict (``convert_hf_moe``'s names, e.g. what ``consolidate``
    writes) under transformers' names again, so ``MixtralForCausalLM`` /
    ``Qwen2MoeForCausalLM`` load it strictly: per MoE layer ``gate.weight`` (the router),
    ``experts.gate_up_proj = [w1.T | w3.T]`` and ``experts.down_proj = w2.T`` per expert, the
    shared expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` and ``shared_expert_gate``.
    Every other entry is kept as it is."""
    out: dict[str, Tensor] = {}
    layers = {k.removesuffix(".router.weight") for k in state if k.endswith(".router.weight")}
    for name, value in state.items():
        prefix = next((p for p in layers if name.startswith(p + ".")), None)
        if prefix is None:
            out[name] = value
            continue
        rest = name[len(prefix) + 1 :]
        if rest == "router.weight":
            out[f"{prefix}.gate.weight"] = value
        elif rest == "experts.w1":
            w3 = state[f"{prefix}.experts.w3"]
            out[f"{prefix}.experts.gate_up_proj"] = torch.cat(
                [value.transpose(1, 2), w3.transpose(1, 2)], dim=1
            )
        elif rest == "experts.w2":
            out[f"{prefix}.experts.down_proj"] = value.transpose(1, 2).contiguous()
        elif rest.startswith("shared.w"):
            hf = {"shared.w1": "gate_proj", "shared.w3": "up_proj", "shared.w2": "down_proj"}[rest]
            out[f"{prefix}.shared_expert.{hf}.weight"] = value[0].t().contiguous()
        elif rest == "shared_gate":
            out[f"{prefix}.shared_expert_gate.weight"] = value
        elif rest != "experts.w3":
            raise ValueError(f"{name}: not a tessera.moe.MoE entry transformers has a name for")
    return out
