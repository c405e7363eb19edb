"""The mixture-of-experts layer, serial, expert-parallel or tensor-parallel inside its
experts, with `shard_experts` and `split_hidden`.

One call routes each token to its ``top_k`` experts, drops assignments beyond the
capacity (`tessera.moe.plan`), runs the kept rows through their experts (here, or on the
ranks that own them: `tessera.moe.exchange`), and sums each token's expert outputs weighted
by the router, plus the shared expert if there is one. A dropped assignment contributes
zero: the caller's residual connection carries the token on. With ``weigh="input"`` (Llama 4)
the router's weight scales each routed row before its expert instead of the expert's output
after it; the weighted rows are what travels to the experts' ranks, so the router's gradient
comes back through the experts (and the exchange) with them.

Identity experts (``identity_experts=Z``, LongCat-Flash's "zero experts") are ``Z`` further
choices of the router, numbered after the ``E`` real ones, whose output is the token itself:
a token choosing one adds ``weight * x``. They hold no weights, cost no compute beyond that
product, and their rows never travel: each rank adds them from its own tokens, before the
real experts' rows leave for their owners (under tp, on the group's first rank only, so the
sum over the group counts them once). They are never dropped (a capacity is refused with
them); the losses and the load the choice bias balances count all ``E + Z`` choices, the
statistics (`MoEStats`) the real experts only.

A post-norm (``post_norm_eps``, AXK1's ``post_mlp_layernorm``) is an RMS norm with a trained
weight ``post_norm [d]`` (ones at first) applied to the layer's output: the sum of the
experts' and the shared expert's outputs, per token. Per-expert norms (``expert_norm_eps``,
``shared_norm_eps``: Ergo) normalise each expert's own output before it is weighed
(`tessera.moe.norms`); the shared experts, and the router's weights for them
(``shared_scores``: Inkling), are `tessera.moe.shared`'s. An input norm (``input_norm_eps``,
Gemma 4's) gives the experts, routed and shared, ``input_norm * x / rms(x)`` (a trained weight
``input_norm [d]``, ones at first) while the router reads ``x`` itself (through its own norm,
with ``router_norm_eps``: `tessera.moe.router`); under tp its weight is whole on every rank,
its gradient a partial sum, as the router's.

Every router the layer holds is called alike, ``router(x, input_ids, tp_group=..., carried=...)
-> Routing``, on the layer's input (whole tokens under tp). It may be a module kept as its model
wrote it (`tessera.moe.kept_router.KeptRouter`, set as ``router`` after construction: PhiMoE's
sampled sparsemixer, ZAYA's MLP router), whose tp ranks draw the same samples. Its `Routing` says
the tokens the experts read (``inputs``: the input flattened, or PhiMoE's jittered tokens) and may
carry a state to the next layer's router (``carried``: `forward_routed`).

Under expert parallelism every rank holds its own tokens (as in data parallelism), the
router and the shared expert are replicated, and each rank holds ``experts / ep`` experts.
The capacity, the losses and the statistics are those of the rank's own tokens, so each
rank computes exactly what the serial layer computes on that rank's tokens.

Tensor parallelism inside the experts (`split_hidden`, Megatron's expert tensor
parallelism) splits every expert's hidden units, and the shared expert's, over a tp group.
The layer is then a tp region of its own: its input enters it once (with sequence
parallelism, each rank's slice of the sequence is all-gathered; under 2D, 2.5D and 3D tensor
parallelism, whose ranks each hold a block of the batch and of the hidden, both are gathered
along the lines of the grid: ``gathers``), so every tp rank routes the same whole tokens,
with the serial layer's capacity and losses; each rank computes its share of every expert's
output, and the sum over the group (with gathers, reduce-scatters back to each rank's block,
in the reverse order) leaves the region. The router and the shared
gate are whole on every tp rank and their gradients are partial sums to be summed over tp
(as any whole parameter inside a tp region); the losses, which every tp rank computes whole,
weigh ``1 / tp`` on each in the backward so that sum counts them once (`aux.scale_grad`).
A post-norm applies after the region, to whole tokens: with sequence parallelism to each
rank's slice (its weight's gradient a partial sum over the slices), else to the same whole
output on every rank (its weight's gradient on each taken from its own share of the tokens,
so that the sum over tp counts each once);
2D, 2.5D and 3D tensor parallelism, which leave each rank a block of the hidden, refuse it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tessera.comm import (
    all_gather_along,
    copy_to_region,
    group_rank,
    group_size,
    reduce_from_region,
    reduce_scatter_along,
)
from tessera.moe.aux import attach_aux, scale_grad
from tessera.moe.balance import count_load
from tessera.moe.exchange import combine, dispatch, plan_exchange
from tessera.moe.experts import Activation, Experts
from tessera.moe.init import SHARED_GATE_STREAM, expert_stream, generator, shared_stream, uniform
from tessera.moe.losses import load_balancing_loss, z_loss
from tessera.moe.norms import post_normed, rms_normed
from tessera.moe.plan import capacity, plan_dispatch
from tessera.moe.router import RouterSpec, Routing, TopKRouter
from tessera.moe.shared import shared_output
from tessera.moe.splits import Gather, ep_split, hidden_split_problem, shard_experts, split_hidden

__all__ = [
    "Gather",
    "MoE",
    "MoEStats",
    "Weigh",
    "hidden_split_problem",
    "set_aux_grad_scale",
    "shard_experts",
    "split_hidden",
]

_log = logging.getLogger(__name__)

Weigh = Literal["output", "input"]
"""Where the router's weight of a routed row applies: to its expert's output (Mixtral, and
most) or to its input (Llama 4: ``expert(w * x)``, which differs for any expert that is not
linear)."""
WEIGHS: tuple[Weigh, ...] = ("output", "input")


@dataclass(frozen=True, slots=True)
class MoEStats:
    """One call's routing on this rank: ``routed [E]`` assignments that chose each expert,
    ``kept [E]`` of them kept under the capacity."""

    routed: Tensor
    kept: Tensor

    @property
    def tokens_per_expert(self) -> Tensor:
        """Assignments routed to each expert (before capacity drops)."""
        return self.routed

    @property
    def dropped_fraction(self) -> float:
        """The fraction of this call's assignments dropped for capacity (0 for no tokens)."""
        total = int(self.routed.sum())
        return (total - int(self.kept.sum())) / total if total else 0.0


class MoE(nn.Module):
    """Top-k mixture of ``experts`` MLPs ``d_model -> hidden -> d_model`` over ``x [..., d_model]``.

    ``capacity_factor``: each expert keeps at most ``ceil(factor * T * top_k / experts)``
    assignments of a call's ``T`` tokens (on this rank), the first in token order; None keeps
    all (drop-less). ``renormalize``: the ``top_k`` weights of a token sum to 1. ``routing``:
    sigmoid scores, a choice bias, group-limited choice, scaled weights (`RouterSpec`; None:
    softmax top-k). ``weigh``: scale each routed row's expert ``output`` by its routing weight
    (the default), or its ``input`` (Llama 4).
    ``expert_bias`` / ``router_bias``: the routed experts' projections / the router's logits have
    trained biases (zeros at first; GPT-OSS; the shared expert has none).
    ``identity_experts``: the router chooses among ``experts + identity_experts``, the further
    ones giving the token itself (module docstring; drop-less only).
    ``post_norm_eps``: RMS-normalise the output with this epsilon and a trained weight
    ``post_norm [d_model]`` (module docstring; None: no norm).
    ``expert_norm_eps``: RMS-normalise each routed expert's output with its own trained weight
    (``experts.norm [E, d_model]``) before it is weighed (`tessera.moe.norms`; Ergo).
    ``shared_hidden``: add an always-on MLP of that width (``shared_experts`` of them, summed);
    ``shared_gate``: scale its output per token by ``sigmoid(x @ shared_gate.T)`` (``shared_gate
    [1, d_model]``, as Qwen2-MoE); ``shared_scores``: weigh each shared expert by the router, which
    holds a logit per shared expert and renormalises over the chosen and the shared experts
    (`tessera.moe.shared`; sigmoid scores; Inkling); ``shared_norm_eps``: normalise each shared
    expert's output as ``expert_norm_eps`` does (``shared.norm [S, d_model]``).
    ``router_scale``: the router's weights times a trained scalar ``router.scale`` (Inkling).
    ``router_norm_eps`` / ``router_input_multiplier`` / ``router_expert_scale``: the router reads
    ``rms_norm(x) * router.input_scale * multiplier`` and scales each chosen weight by a trained
    ``router.expert_scale [E]`` (`TopKRouter`; Gemma 4). ``input_norm_eps``: the experts read
    ``input_norm * rms_norm(x)`` (module docstring; no identity experts).
    ``hash_vocab``: the router reads each token's experts from a table ``router.tid2eid
    [hash_vocab, top_k]`` at its id (`tessera.moe.hash_routing`; DeepSeek-V4): ``forward(x,
    input_ids)`` then needs the ids (of ``x``'s leading shape; ignored without a table).
    ``grouped=False`` runs the experts one by one (the reference of the batched path).
    ``seed``: the initialisation (`tessera.moe.init`; None draws one from torch's global
    generator). ``ep_group``: hold only this rank's ``experts / ep`` experts and exchange
    tokens over the group (None: serial); every rank must pass the same ``seed``.

    After each forward: ``aux_loss`` (load balancing, `load_balancing_loss`), ``z_loss``
    (router z-loss) and ``stats`` (`MoEStats`) describe that call on this rank.
    ``aux_loss_coef`` / ``z_loss_coef``: train the router on ``coef * loss`` of each call from
    inside the layer's backward (`tessera.moe.aux`), scaled by ``aux_grad_scale`` (1: set it
    with `set_aux_grad_scale` to the factor the caller's backward multiplies its loss by); 0:
    the caller adds the losses itself, if at all. ``bias_rate``: with a choice bias in
    ``routing``, DeepSeek-V3's auxiliary-loss-free balancing (`tessera.moe.balance`): the
    layer counts each trained call's load, and `balance_choice_biases` after each step moves
    the bias by ``bias_rate`` per expert against its load.
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        experts: int,
        top_k: int = 2,
        *,
        activation: Activation = "swiglu",
        capacity_factor: float | None = None,
        renormalize: bool = True,
        routing: RouterSpec | None = None,
        weigh: Weigh = "output",
        identity_experts: int = 0,
        post_norm_eps: float | None = None,
        expert_norm_eps: float | None = None,
        shared_hidden: int | None = None,
        shared_experts: int = 1,
        shared_gate: bool = False,
        shared_scores: bool = False,
        shared_norm_eps: float | None = None,
        expert_bias: bool = False,
        router_bias: bool = False,
        router_scale: bool = False,
        router_norm_eps: float | None = None,
        router_input_multiplier: float = 1.0,
        router_expert_scale: bool = False,
        input_norm_eps: float | None = None,
        hash_vocab: int | None = None,
        grouped: bool = True,
        seed: int | None = None,
        ep_group: dist.ProcessGroup | None = None,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        bias_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if experts < 1:
            raise ValueError(f"experts must be >= 1, got {experts}")
        if not 1 <= top_k <= experts + max(identity_experts, 0):
            raise ValueError(
                f"top_k ({top_k}) must be between 1 and experts ({experts}) + identity experts "
                f"({identity_experts})"
            )
        capacity(1, experts, top_k, capacity_factor)  # refuses a factor <= 0
        if weigh not in WEIGHS:
            raise ValueError(f"weigh must be one of {WEIGHS}, got {weigh!r}")
        if identity_experts < 0:
            raise ValueError(f"identity_experts must be >= 0, got {identity_experts}")
        if identity_experts and capacity_factor is not None:
            raise ValueError(
                f"identity_experts ({identity_experts}) are drop-less: capacity_factor must be None, "
                f"got {capacity_factor}"
            )
        for name, eps in (("post_norm_eps", post_norm_eps), ("input_norm_eps", input_norm_eps)):
            if eps is not None and not (math.isfinite(eps) and eps > 0):
                raise ValueError(f"{name} must be finite and > 0 (or None), got {eps}")
        if identity_experts and input_norm_eps is not None:
            raise ValueError(
                f"identity_experts ({identity_experts}) with input_norm_eps ({input_norm_eps}): which "
                "input an identity expert gives back (the token or its normed copy) is not defined"
            )
        asked = {
            "shared_gate": shared_gate,
            "shared_scores": shared_scores,
            f"shared_norm_eps={shared_norm_eps}": shared_norm_eps is not None,
            f"shared_experts={shared_experts}": shared_experts != 1,
        }
        if shared_hidden is None and any(asked.values()):
            raise ValueError(
                f"{', '.join(k for k, v in asked.items() if v)} needs a shared expert (shared_hidden)"
            )
        if shared_experts < 1 or (shared_gate and shared_scores):
            raise ValueError(
                f"shared_experts must be >= 1 (got {shared_experts}), and a shared expert is gated "
                f"(shared_gate) or weighed by the router (shared_scores), not both"
            )
        if bias_rate and not (routing is not None and routing.choice_bias):
            raise ValueError(
                f"bias_rate={bias_rate} needs a router with a choice bias (RouterSpec(choice_bias=True))"
            )
        for name, coef in (
            ("aux_loss_coef", aux_loss_coef),
            ("z_loss_coef", z_loss_coef),
            ("bias_rate", bias_rate),
        ):
            if not coef >= 0:
                raise ValueError(f"{name} must be >= 0, got {coef}")
        if ep_group is not None and seed is None:
            raise ValueError("an ep_group needs an explicit seed: every ep rank must build the same router")
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        start, stop = (0, experts) if ep_group is None else ep_split(experts, ep_group)
        self.num_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.identity_experts = identity_experts
        self.grouped, self.ep_group = grouped, ep_group
        self.weigh: Weigh = weigh
        self.aux_loss_coef, self.z_loss_coef, self.aux_grad_scale = aux_loss_coef, z_loss_coef, 1.0
        self.bias_rate = bias_rate  # `tessera.moe.balance`: the choice bias moved after each step
        self.pending_load: Tensor | None = None  # this step's assignments per expert (`balance`)
        self.first_expert = start
        self.tp_group: dist.ProcessGroup | None = None  # `split_hidden`
        self.gathers: tuple[Gather, ...] = ()  # `split_hidden`: how the input enters the region
        self.router = TopKRouter(
            d_model,
            experts + identity_experts,
            top_k,
            renormalize=renormalize,
            seed=seed,
            spec=routing,
            bias=router_bias,
            shared=shared_experts if shared_scores else 0,
            scale=router_scale,
            input_norm_eps=router_norm_eps,
            input_multiplier=router_input_multiplier,
            expert_scale=router_expert_scale,
            hash_vocab=hash_vocab,
        )
        self.experts = Experts(
            d_model,
            hidden,
            activation,
            seed=seed,
            streams=[expert_stream(e) for e in range(start, stop)],
            bias=expert_bias,
            norm_eps=expert_norm_eps,
        )
        self.shared = (
            None
            if shared_hidden is None
            else Experts(
                d_model,
                shared_hidden,
                activation,
                seed=seed,
                streams=[shared_stream(s) for s in range(shared_experts)],
                norm_eps=shared_norm_eps,
            )
        )
        self.shared_gate = (
            nn.Parameter(uniform((1, d_model), d_model, generator(seed, SHARED_GATE_STREAM)))
            if shared_gate
            else None
        )
        self.post_norm_eps = post_norm_eps
        self.post_norm = None if post_norm_eps is None else nn.Parameter(torch.ones(d_model))
        self.input_norm_eps = input_norm_eps
        self.input_norm = None if input_norm_eps is None else nn.Parameter(torch.ones(d_model))
        self.aux_loss: Tensor = torch.zeros(())
        self.z_loss: Tensor = torch.zeros(())
        self.stats = MoEStats(torch.zeros(experts, dtype=torch.long), torch.zeros(experts, dtype=torch.long))

    @property
    def tp(self) -> int:
        """How many ranks share every expert's hidden units (`split_hidden`; 1: none)."""
        return 1 if self.tp_group is None else group_size(self.tp_group)

    def forward(self, x: Tensor, input_ids: Tensor | None = None) -> Tensor:
        return self.forward_routed(x, input_ids)[0]

    def forward_routed(
        self, x: Tensor, input_ids: Tensor | None = None, *, carried: Tensor | None = None
    ) -> tuple[Tensor, Routing]:
        """The layer's output and its router's `Routing` of ``x``, the router given the state
        ``carried`` from the previous layer's (a kept router's; `Routing.carried` the next one)."""
        tp = self.tp
        hashed = self.router.tid2eid is not None
        if hashed and tp > 1 and self.gathers:
            raise ValueError(
                f"a hash-routed MoE layer under tp={tp} with its input gathered ({len(self.gathers)} "
                "gathers: sequence parallelism or 2D / 2.5D / 3D tp) is not supported: its token ids are "
                "not gathered"
            )
        if tp > 1:  # enter the layer's tp region: every rank routes the same whole tokens
            for dim, group in self.gathers:
                x = all_gather_along(x, dim, group)
            if not self.gathers:
                x = copy_to_region(x, self.tp_group)
        routing = self.router(x, input_ids, tp_group=self.tp_group, carried=carried)
        # the tokens the experts read: the router's view of x (its gradient summed there with the
        # router's), or as the router's call changed them (PhiMoE's jitter)
        tokens = x.reshape(-1, x.shape[-1]) if routing.inputs is None else routing.inputs
        if self.input_norm is not None and self.input_norm_eps is not None:  # what the experts read
            tokens = rms_normed(tokens, self.input_norm, self.input_norm_eps)
        experts = self.num_experts
        cap = capacity(tokens.shape[0], experts, self.top_k, self.capacity_factor)
        plan = plan_dispatch(routing.choices, experts + self.identity_experts, cap)
        # sorted by expert: the real experts' assignments first, then the identity experts'
        real = int(plan.kept[:experts].sum()) if self.identity_experts else plan.token.numel()
        token, assignment = plan.token[:real], plan.assignment[:real]
        rows = tokens.index_select(0, token)
        # in the router's dtype: fp32 where its spec says weights_float32 (Mixtral's), else the input's
        weights = routing.weights.reshape(-1).index_select(0, assignment)[:, None]
        if self.weigh == "input":  # the weighted rows travel: the router's gradient comes back with them
            rows = (rows * weights).to(rows.dtype)
        kept = plan.kept[:experts]
        if self.ep_group is None or group_size(self.ep_group) == 1:
            out_rows = self.experts(rows, kept, grouped=self.grouped)
        else:
            ex = plan_exchange(kept, self.ep_group)
            local = self.experts(dispatch(rows, ex, self.ep_group), ex.local_counts, grouped=self.grouped)
            out_rows = combine(local, ex, self.ep_group)
        if self.weigh == "output":  # in the weights' dtype where it is wider (fp32 weights, bf16 rows)
            out_rows = out_rows * weights
        # each token's rows summed in fp32 (or wider) and rounded once, as transformers' experts sum them
        wide = torch.promote_types(out_rows.dtype, torch.float32)
        out = tokens.new_zeros(tokens.shape, dtype=wide).index_add(0, token, out_rows.to(wide))
        out = out.to(tokens.dtype)
        if real < plan.token.numel() and (tp == 1 or group_rank(self.tp_group) == 0):
            out = out + self._identity(tokens, routing.weights, plan.token[real:], plan.assignment[real:])
        if self.shared is not None:
            out = out + shared_output(self.shared, tokens, self.shared_gate, routing.shared_weights)
        self.aux_loss = load_balancing_loss(routing.probs, plan.routed)
        self.z_loss = z_loss(routing.logits)
        if tp > 1:  # computed whole on every tp rank, whose router gradients are summed over tp
            self.aux_loss, self.z_loss = scale_grad(self.aux_loss, 1 / tp), scale_grad(self.z_loss, 1 / tp)
        self.stats = MoEStats(routed=plan.routed[:experts], kept=kept)
        out = out.view(x.shape)
        if tp > 1:  # leave the region: the shares of every expert's output summed
            for dim, group in reversed(self.gathers):
                out = reduce_scatter_along(out, dim, group)
            if not self.gathers:
                out = reduce_from_region(out, self.tp_group)
        if self.post_norm is not None and self.post_norm_eps is not None:
            whole = not self.gathers  # every tp rank holds the same whole output, else its own slice
            out = post_normed(out, self.post_norm, self.post_norm_eps, self.tp_group, whole, tp)
        if (self.aux_loss_coef or self.z_loss_coef) and torch.is_grad_enabled():
            weighted = self.aux_loss_coef * self.aux_loss + self.z_loss_coef * self.z_loss
            out = attach_aux(out, weighted, self)
        if self.bias_rate and torch.is_grad_enabled():
            out = count_load(out, plan.routed, self)
        return out, routing

    @staticmethod
    def _identity(tokens: Tensor, weights: Tensor, token: Tensor, assignment: Tensor) -> Tensor:
        """The identity experts' share of the output: ``weight * x`` for each of their
        assignments (``token`` and ``assignment`` as `plan_dispatch` numbers them), summed per token."""
        w = weights.reshape(-1).index_select(0, assignment).to(tokens.dtype)[:, None]
        return tokens.new_zeros(tokens.shape).index_add(0, token, tokens.index_select(0, token) * w)


def set_aux_grad_scale(module: nn.Module, scale: float) -> int:
    """Set ``aux_grad_scale`` of every `MoE` in ``module`` to ``scale``: the factor the
    caller's next backward multiplies its loss by (``loss_scale / microbatches``), so the
    attached auxiliary losses weigh what they would in that loss. Returns how many layers."""
    if not scale > 0:
        raise ValueError(f"the auxiliary gradient scale must be > 0, got {scale}")
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    for m in layers:
        m.aux_grad_scale = float(scale)
    return len(layers)
