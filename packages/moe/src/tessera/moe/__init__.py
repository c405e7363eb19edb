"""tessera.moe: mixture-of-experts layers with expert parallelism.

`MoE` routes tokens to their top-k experts (stacked expert weights run as one batched
matmul), with capacity and drop-less modes, load-balancing and z auxiliary losses and
shared experts (weighed by the router, Inkling's "shared gammas": `tessera.moe.shared`),
per-expert output norms (Ergo's: `tessera.moe.norms`), and routers of DeepSeek's kinds
(`RouterSpec`: sigmoid scores, a choice bias, group-limited top-k, a routed scale, the bias
moved by the experts' load after each step: `balance_choice_biases`), low-rank adapters on
the experts and the router (`ExpertAdapter`, `RouterAdapter`), routers kept as their model wrote
them (`KeptRouter`: PhiMoE's sampled sparsemixer, ZAYA's MLP router); with an ``ep_group`` (or
`shard_experts`) its experts are split over the group's ranks and tokens travel to them by
uneven all-to-all; with `split_hidden` every expert's hidden units are split over a
tensor-parallel group. Depends on torch and ``tessera.comm`` only.
"""

from __future__ import annotations

from tessera.moe.adapters import ExpertAdapter, RouterAdapter
from tessera.moe.balance import balance_choice_biases, set_bias_rate
from tessera.moe.experts import Activation, ClampedSwiGLU, Experts, SwiGLUVariant
from tessera.moe.grads import expert_parameters, reduce_gradients
from tessera.moe.kept_router import KeptChoice, KeptRouter
from tessera.moe.layer import Gather, MoE, MoEStats, Weigh, set_aux_grad_scale, shard_experts, split_hidden
from tessera.moe.losses import load_balancing_loss, z_loss
from tessera.moe.plan import DispatchPlan, capacity, plan_dispatch
from tessera.moe.router import RouterSpec, Routing, TopKRouter, route

__version__ = "0.1.0"

__all__ = [
    "Activation",
    "ClampedSwiGLU",
    "DispatchPlan",
    "ExpertAdapter",
    "Experts",
    "Gather",
    "KeptChoice",
    "KeptRouter",
    "MoE",
    "MoEStats",
    "RouterAdapter",
    "RouterSpec",
    "Routing",
    "SwiGLUVariant",
    "TopKRouter",
    "Weigh",
    "balance_choice_biases",
    "capacity",
    "expert_parameters",
    "load_balancing_loss",
    "plan_dispatch",
    "reduce_gradients",
    "route",
    "set_aux_grad_scale",
    "set_bias_rate",
    "shard_experts",
    "split_hidden",
    "z_loss",
]
