"""The main job's mixture of experts: the reference GPT with a ``tessera.moe.MoE`` as each
layer's MLP (``[moe]``, `moe_gpt`), its model spec (`MOE_GPT_SPEC`: the reference GPT's
roles with each mixture split inside its experts over tp, `moe_style`), and the expert load
it logs (`ExpertLoad`).

The reference GPT (``tessera.models``) knows nothing of experts; this module builds it and
replaces each ``layers.i.mlp`` by an ``MoE`` of ``[moe].experts`` SwiGLU experts of
``[moe].expert_hidden`` (0: the dense MLP's width) and a shared expert when
``[moe].shared_hidden`` > 0, initialised from ``seed + i`` (``tessera.moe.init``: the same weights on
every rank, whatever the global RNG). The router's auxiliary losses are trained from inside
each layer (``aux_loss_coef``, ``z_loss_coef``); the caller sets their backward scale with
``tessera.moe.set_aux_grad_scale`` before each step (the main job: the loss scale over the
microbatches).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from tessera.comm import all_reduce
from tessera.launcher.config import MoEConfig
from tessera.launcher.families import REFERENCE_GPT_SPEC
from tessera.launcher.train import MOE_STYLE
from tessera.models import GPT, GPTConfig
from tessera.moe import MoE
from tessera.tensor_parallel import GPT_PLAN, Plan

__all__ = ["MOE_GPT_PLAN", "MOE_GPT_SPEC", "ExpertLoad", "moe_gpt"]

MOE_GPT_PLAN = Plan.of(
    {
        **{p: s for p, s in GPT_PLAN.as_dict().items() if not p.startswith("layers.*.mlp")},
        "layers.*.mlp": MOE_STYLE,  # a tp region of its own: every expert's hidden units split over tp
    },
    name="tessera-moe-gpt",
)
MOE_GPT_SPEC = dataclasses.replace(REFERENCE_GPT_SPEC, roles=MOE_GPT_PLAN)


def moe_gpt(cfg: GPTConfig, moe: MoEConfig, *, seed: int) -> GPT:
    """The reference GPT of ``cfg`` whose every layer's MLP is an `MoE` as ``moe`` says."""
    model = GPT(cfg, seed=seed)
    hidden, shared = moe.widths(cfg.d_model, cfg.mlp_ratio)
    for i, layer in enumerate(model.layers):
        layer.mlp = MoE(
            cfg.d_model,
            hidden,
            moe.experts,
            moe.top_k,
            capacity_factor=None if moe.dropless else moe.capacity_factor,
            shared_hidden=shared or None,
            seed=seed + i,
            aux_loss_coef=moe.aux_loss_coef,
            z_loss_coef=moe.z_loss_coef,
        )
    return model


class ExpertLoad:
    """Counts, over the training forwards of every `MoE` in ``module``, the assignments each
    expert was routed and kept, until `collect` sums them over the ranks and starts again."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = [m for m in module.modules() if isinstance(m, MoE)]
        experts = self.layers[0].num_experts if self.layers else 0
        self.routed = torch.zeros(len(self.layers), experts, dtype=torch.long)
        self.kept = torch.zeros_like(self.routed)
        self._hooks: list[RemovableHandle] = [
            m.register_forward_hook(self._counter(i)) for i, m in enumerate(self.layers)
        ]

    def _counter(self, index: int) -> Any:
        def count(module: nn.Module, args: Any, output: Any) -> None:
            if module.training and isinstance(module, MoE):
                self.routed[index] += module.stats.routed.cpu()
                self.kept[index] += module.stats.kept.cpu()

        return count

    def collect(
        self, group: dist.ProcessGroup | None = None, *, device: torch.device | None = None
    ) -> dict[str, Any]:
        """Collective over ``group`` (None: the world): the counts since the last call summed
        over its ranks, as ``expert_share`` (each expert's share of the assignments, over every
        layer), ``expert_share_by_layer`` and ``dropped_fraction`` (of the assignments, dropped
        for capacity); then zero. Moves ``2 * layers * experts`` integers."""
        both = torch.stack([self.routed, self.kept]).to(device or torch.device("cpu"))
        both = all_reduce(both, group).cpu()
        self.routed.zero_()
        self.kept.zero_()
        routed, kept = both[0].double(), both[1].double()
        total = float(routed.sum())
        return {
            "expert_share": _shares(routed.sum(0)),
            "expert_share_by_layer": [_shares(r) for r in routed],
            "dropped_fraction": (total - float(kept.sum())) / total if total else 0.0,
        }

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._hooks:
            h.remove()


def _shares(counts: Tensor) -> list[float]:
    total = float(counts.sum())
    return [float(c) / total if total else 0.0 for c in counts]
