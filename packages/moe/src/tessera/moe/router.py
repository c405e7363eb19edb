"""The top-k router: a linear map to one logit per expert (no bias unless asked), scores, top-k.

By default (Mixtral, Qwen, OLMoE) the scores are the softmax of the logits in fp32 and a
token's ``top_k`` experts are those of highest probability, weighted by their probabilities
(renormalised to sum to 1 when asked). A `RouterSpec` describes the routers of DeepSeek-V2,
DeepSeek-V3 and the families that copy them, in four independent parts:

- ``score="sigmoid"``: each expert's score is ``sigmoid(logit)``, on its own (DeepSeek-V3);
  ``score="sqrtsoftplus"``: ``sqrt(softplus(logit))``, on its own too (DeepSeek-V4);
- ``choice_bias=True``: the router holds a buffer ``score_bias [E]`` (DeepSeek-V3's
  ``e_score_correction_bias``) added to the scores to *choose* the experts (and the groups),
  never to weigh them: the weights are the chosen experts' unbiased scores. This is
  DeepSeek-V3's auxiliary-loss-free balancing, whose paper moves the bias after each step by
  ``-gamma`` for an overloaded expert and ``+gamma`` for an underloaded one. ``transformers``
  does not implement that update (its bias is a buffer read from the checkpoint and left as
  it is in training). The router itself never changes ``score_bias``, no gradient reaches it
  (it is not a parameter), and an optimizer does not see it; an `MoE` layer built with
  ``bias_rate=gamma`` counts its load and `tessera.moe.balance_choice_biases` makes the update
  after each step (the launcher's engine calls it);
- ``groups=G, top_groups=M``: the ``E`` experts form ``G`` groups of ``E / G`` consecutive
  experts; each token keeps its ``M`` groups of highest group score (``group_score="max"``: the
  best (biased) score in the group, DeepSeek-V2's ``group_limited_greedy``; ``"top2"``: the sum
  of the two best, DeepSeek-V3) and chooses its ``top_k`` experts among theirs only;
- ``scale``: the weights, after renormalisation, multiplied by ``scale`` (DeepSeek's
  ``routed_scaling_factor``).

Three details some families change: ``choose_by="logits"`` chooses by the logits (plus the
choice bias) instead of the scores, still weighing by the chosen experts' scores (Kolibri:
``topk(logits + bias)``, weights ``sigmoid(logit)``; without a bias the same choice as by
the scores, as both score functions are monotone in the logits); ``group_fill``: the value
the experts outside the kept groups take for the choice, ``-inf`` (DeepSeek-V3) or ``0.0``
(AXK2: with a negative bias such an expert may still be chosen); ``renorm_eps``: the guard of
the renormalisation, ``sum + renorm_eps``.

Hash routing (DeepSeek-V4's first layers; `TopKRouter`'s ``hash_vocab``): each token's experts
are not chosen by the scores but read from a fixed table ``tid2eid [vocab, top_k]`` (int64, a
persistent buffer, loaded and never trained) at the token's id (`tessera.moe.hash_routing`);
they are still weighed by the router's scores at those experts, renormalised and scaled as the
spec says, so the router's weight is trained through the weights alone.

Shared experts scored by the router (``shared=S`` in `route`, Inkling's "shared gammas"): the
router holds ``S`` further logits after the choosable ones, one per shared expert of the layer.
They are never chosen; their sigmoid scores join the chosen experts' in the renormalisation
(``sum over the chosen and the shared + renorm_eps``) and are scaled alike, and each shared
expert's output is weighed by its own (`Routing.shared_weights`). Only sigmoid scores (each on
its own) are defined for them. A router built with ``scale=True`` (`TopKRouter`) holds a trained
scalar ``scale [1]`` (ones at first; Inkling's ``global_scale``) multiplying every weight, the
shared ones too, after the spec's ``scale``.

What the router reads and two trained scales (`TopKRouter`'s ``input_norm_eps``,
``input_multiplier``, ``expert_scale``; Gemma 4's): the logits may be those of
``normalised(x) * input_scale * input_multiplier`` (an RMS norm without weight, of epsilon
``input_norm_eps``, times a trained per-channel ``input_scale [d]`` and a constant), and each
chosen expert's weight, after renormalisation, may be multiplied by that expert's entry of a trained
``expert_scale [E]`` (what the load-balancing loss reads is unchanged: the probabilities).

The logits' dtype: by default the input's (in a bf16 model, bf16 logits; the scores are
computed in fp32 from them). ``float32=True``: the logits of the input and the weight cast to
fp32, as DeepSeek-V3's and many later routers compute them in any dtype (in bf16, a router
computing bf16 logits rounds them to 8 bits of mantissa, which changes the choice of tokens
whose experts' scores are that close).

``in_logits_dtype=True``: the scores, their renormalisation and scale computed in the logits'
dtype, as DBRX's ``softmax(logits, dtype=logits.dtype)`` and LFM2's ``logits.sigmoid()`` compute
them (each fp32 step rounded to that dtype: what one bf16 operation gives); in bf16 tied scores
then choose as transformers' choose. In fp32 nothing changes.

Outside the default, renormalisation divides by ``sum + 1e-20`` as DeepSeek-V3 does (no
difference unless the chosen scores sum below about ``1e-13``; LFM2 adds ``1e-6``). The
default spec takes the original code path, so a default router routes bit for bit as before
`RouterSpec` existed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.moe.adapters import deltas
from tessera.moe.hash_routing import hash_choices, hash_table
from tessera.moe.init import ROUTER_STREAM, generator, uniform
from tessera.moe.norms import normalised

__all__ = [
    "ChooseBy",
    "GroupScore",
    "RouterSpec",
    "Routing",
    "ScoreFunction",
    "TopKRouter",
    "limit_to_groups",
    "route",
    "scores_of",
]

ScoreFunction = Literal["softmax", "sigmoid", "sqrtsoftplus"]
GroupScore = Literal["max", "top2"]
ChooseBy = Literal["scores", "logits"]
_EPS = 1e-20  # DeepSeek-V3's renormalisation guard


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """How a router turns logits into choices and weights (module docstring). The default is
    softmax, no bias, one group, scale 1: Mixtral's router. ``float32``: `TopKRouter` computes
    the logits from its input and weight cast to fp32, whatever their dtype (module docstring).
    ``weights_float32``: its weights stay fp32 (computed so, from the logits), so that the experts'
    outputs are weighed in fp32 and then rounded to their dtype, as Mixtral's and DeepSeek-V3's
    experts weigh theirs; else the weights are rounded to the input's dtype first (Qwen's).
    ``in_logits_dtype``: the scores and weights computed in the logits' dtype (module docstring)."""

    score: ScoreFunction = "softmax"
    choice_bias: bool = False
    groups: int = 1
    top_groups: int = 1
    group_score: GroupScore = "max"
    scale: float = 1.0
    choose_by: ChooseBy = "scores"
    group_fill: float = float("-inf")
    renorm_eps: float = _EPS
    float32: bool = False
    weights_float32: bool = False
    in_logits_dtype: bool = False

    @property
    def is_default(self) -> bool:
        """Whether this is plain softmax top-k (the original code path; in whatever dtype)."""
        return replace(self, float32=False, weights_float32=False) == RouterSpec()

    def problem(self, experts: int, top_k: int) -> str:
        """Why this spec cannot route ``top_k`` of ``experts`` experts ("" when it can)."""
        if self.score not in ("softmax", "sigmoid", "sqrtsoftplus"):
            return (
                f"score must be 'softmax' or 'sigmoid', got {self.score!r} (or DeepSeek-V4's 'sqrtsoftplus')"
            )
        if self.group_score not in ("max", "top2"):
            return f"group_score must be 'max' or 'top2', got {self.group_score!r}"
        if not (math.isfinite(self.scale) and self.scale > 0):
            return f"scale must be finite and > 0, got {self.scale}"
        if self.choose_by not in ("scores", "logits"):
            return f"choose_by must be 'scores' or 'logits', got {self.choose_by!r}"
        if not (self.group_fill == float("-inf") or math.isfinite(self.group_fill)):
            return f"group_fill must be -inf or finite, got {self.group_fill}"
        if not (math.isfinite(self.renorm_eps) and self.renorm_eps >= 0):
            return f"renorm_eps must be finite and >= 0, got {self.renorm_eps}"
        if self.groups < 1 or experts % self.groups:
            return f"groups ({self.groups}) must be >= 1 and divide experts ({experts})"
        if not 1 <= self.top_groups <= self.groups:
            return f"top_groups ({self.top_groups}) must be between 1 and groups ({self.groups})"
        per_group = experts // self.groups
        if self.top_groups * per_group < top_k:
            return (
                f"top_groups ({self.top_groups}) x experts per group ({per_group}) must be >= top_k "
                f"({top_k}): the kept groups must hold top_k experts"
            )
        if self.groups > 1 and self.group_score == "top2" and per_group < 2:
            return f"group_score 'top2' needs >= 2 experts per group, got {per_group} (experts {experts})"
        return ""


@dataclass(frozen=True, slots=True)
class Routing:
    """One call's routing of ``T`` tokens over ``E`` experts.

    ``logits``: ``[T, E]``; ``probs``: ``[T, E]`` in fp32, the router's probabilities that the
    load-balancing loss reads: the softmax of the logits, or with sigmoid (or sqrtsoftplus) scores
    those scores normalised to sum to 1 per token (as DeepSeek-V3's sequence-wise balance loss does);
    ``choices``: ``[T, k]`` expert indices, highest (biased) score first; ``weights``: ``[T, k]``
    their combine weights (the unbiased scores, renormalised to sum to 1 per token when asked,
    times the spec's scale); ``shared_weights``: ``[T, S]`` the shared experts' weights where the
    router scores them (module docstring), else None. ``logits`` and ``probs`` cover the
    choosable experts only. A router module (`TopKRouter`, `tessera.moe.kept_router.KeptRouter`)
    also gives ``inputs``: ``[T, d]`` the tokens the layer's experts read, its input flattened or as
    a kept router's call changed them (PhiMoE's jitter); a kept router may give ``carried``: the
    state for the next layer's router (ZAYA's). None where not given (`route` gives neither).
    """

    logits: Tensor
    probs: Tensor
    choices: Tensor
    weights: Tensor
    shared_weights: Tensor | None = None
    carried: Tensor | None = None
    inputs: Tensor | None = None


def limit_to_groups(
    choice: Tensor, groups: int, top_groups: int, group_score: GroupScore, fill: float = float("-inf")
) -> Tensor:
    """``choice [T, E]`` with every expert outside each token's ``top_groups`` best groups of
    ``E / groups`` consecutive experts set to ``fill`` (group score: the best expert's, or the
    sum of the best two)."""
    tokens, experts = choice.shape
    per_group = choice.view(tokens, groups, experts // groups)
    if group_score == "max":
        group = per_group.max(dim=-1).values
    else:
        group = per_group.topk(2, dim=-1).values.sum(dim=-1)
    kept = torch.zeros_like(group, dtype=torch.bool)
    kept.scatter_(1, torch.topk(group, top_groups, dim=-1).indices, True)
    return choice.masked_fill(~kept.repeat_interleave(experts // groups, dim=1), fill)


def scores_of(logits: Tensor, score: ScoreFunction) -> Tensor:
    """Each expert's score of ``logits [T, E]``: their softmax, or each one's sigmoid or
    ``sqrt(softplus(logit))`` (`RouterSpec`'s ``score``)."""
    if score == "softmax":
        return torch.softmax(logits, dim=-1)
    return torch.sigmoid(logits) if score == "sigmoid" else F.softplus(logits).sqrt()


def route(
    logits: Tensor,
    top_k: int,
    *,
    renormalize: bool,
    spec: RouterSpec | None = None,
    bias: Tensor | None = None,
    shared: int = 0,
    chosen: Tensor | None = None,
) -> Routing:
    """Each token's ``top_k`` experts and weights from ``logits [T, E]`` (in fp32): softmax
    top-k by default, else as ``spec`` says, choosing by the scores plus ``bias [E]`` (given
    exactly when ``spec.choice_bias``; by the logits plus ``bias`` with ``spec.choose_by="logits"``).
    ``shared``: the last ``shared`` of the logits score the shared experts (module docstring;
    sigmoid scores only), ``bias`` and the choice covering the ``E - shared`` others.
    ``chosen [T, top_k]``: each token's experts, given (hash routing: module docstring), not
    chosen by the scores; they are weighed as chosen ones are."""
    experts = logits.shape[-1] - shared
    if shared < 0 or not 1 <= top_k <= experts:
        raise ValueError(
            f"top_k must be in [1, experts={experts}] and shared ({shared}) >= 0, got top_k={top_k}"
        )
    spec = spec or RouterSpec()
    if shared and spec.score != "sigmoid":
        raise ValueError(
            f"a router scoring {shared} shared experts needs sigmoid scores (RouterSpec(score='sigmoid')), "
            f"got {spec.score!r}: a softmax would make them compete with the routed experts for the choice"
        )
    if spec.is_default and chosen is None:
        if bias is not None:
            raise ValueError("a choice bias needs RouterSpec(choice_bias=True)")
        probs = torch.softmax(logits.float(), dim=-1)
        weights, choices = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(logits=logits, probs=probs, choices=choices, weights=weights)
    problem = spec.problem(experts, top_k)
    if problem:
        raise ValueError(problem)
    if spec.choice_bias != (bias is not None) or (bias is not None and bias.shape != (experts,)):
        shape = None if bias is None else tuple(bias.shape)
        raise ValueError(
            f"choice_bias={spec.choice_bias} needs a bias of shape ({experts},) exactly then, got {shape}"
        )
    if chosen is not None and (
        bias is not None or spec.groups > 1 or tuple(chosen.shape) != (len(logits), top_k)
    ):
        raise ValueError(
            f"given choices of shape {tuple(chosen.shape)} need shape ({len(logits)}, {top_k}), no choice "
            f"bias (got {bias is not None}) and one group (got {spec.groups}): nothing is chosen"
        )
    dtype = logits.dtype

    def step(t: Tensor) -> Tensor:  # one operation in the logits' dtype where the spec says so
        return t.to(dtype).float() if spec.in_logits_dtype else t

    everyone = step(scores_of(logits.float(), spec.score))
    shared_weights = everyone[:, experts:] if shared else None
    scores, logits = (everyone[:, :experts], logits[:, :experts]) if shared else (everyone, logits)
    if chosen is None:
        choice = (scores if spec.choose_by == "scores" else logits.float()).detach()
        if bias is not None:  # in the logits' dtype, the bias's where wider (LFM2's bf16 scores + bias)
            choice = choice + bias.float()
            if spec.in_logits_dtype:
                choice = choice.to(torch.promote_types(dtype, bias.dtype)).float()
        if spec.groups > 1:
            choice = limit_to_groups(choice, spec.groups, spec.top_groups, spec.group_score, spec.group_fill)
        choices = torch.topk(choice, top_k, dim=-1).indices
    else:
        choices = chosen.long()
    weights = scores.gather(1, choices)
    if renormalize and shared_weights is not None:  # over the chosen and the shared experts together
        total = weights.sum(dim=-1, keepdim=True) + shared_weights.sum(dim=-1, keepdim=True) + spec.renorm_eps
        weights, shared_weights = weights / total, shared_weights / total
    elif renormalize:
        weights = step(weights / step(step(weights.sum(dim=-1, keepdim=True)) + spec.renorm_eps))
    if spec.scale != 1.0:
        weights = step(weights * spec.scale)
        shared_weights = None if shared_weights is None else shared_weights * spec.scale
    probs = scores if spec.score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    return Routing(
        logits=logits, probs=probs, choices=choices, weights=weights, shared_weights=shared_weights
    )


class TopKRouter(nn.Module):
    """``x [..., d] -> Routing`` of its ``T`` tokens (flattened to ``[T, d]``): logits ``x @ weight.T``
    (``weight [E, d]``; with ``bias=True`` plus a trained ``bias [E]``, zeros at first, as GPT-OSS's
    router), routed as ``spec`` says (`route`); with ``spec.choice_bias`` a persistent buffer
    ``score_bias [E]`` (zeros; loaded, never trained: module docstring). Called as every router an
    `MoE` holds is, ``router(x, input_ids, tp_group=..., carried=...)``: it is whole on every tp rank
    and carries no state, so ``tp_group`` and ``carried`` change nothing; its `Routing`'s ``inputs``
    are the flat tokens ``[T, d]`` (the one view of ``x`` the layer's experts read too).

    ``shared``: ``weight`` holds that many further rows scoring the layer's shared experts
    (`route`'s ``shared``); ``scale=True``: a trained ``scale [1]`` (ones) multiplies every weight
    (module docstring). ``input_norm_eps``: the logits read ``normalised(x) * input_scale *
    input_multiplier`` (a trained ``input_scale [d]``, ones); ``expert_scale=True``: a trained
    ``expert_scale [E]`` (ones) multiplies each chosen expert's weight (module docstring).
    ``hash_vocab``: the experts are read from a persistent buffer ``tid2eid [hash_vocab, top_k]``
    (int64, zeros) at each token's id, which ``forward`` then needs (module docstring).

    Initialised uniformly in ``±1/sqrt(d)`` from stream 0 of ``seed`` (`tessera.moe.init`). Under expert
    parallelism every rank holds the same router (a data-parallel parameter). Low-rank
    adapters in ``adapters`` (`tessera.moe.adapters.RouterAdapter`) add their deltas to ``weight``.
    """

    score_bias: Tensor | None
    tid2eid: Tensor | None
    bias: nn.Parameter | None
    scale: nn.Parameter | None
    input_scale: nn.Parameter | None
    expert_scale: nn.Parameter | None

    def __init__(
        self,
        d_model: int,
        experts: int,
        top_k: int,
        *,
        renormalize: bool,
        seed: int,
        spec: RouterSpec | None = None,
        bias: bool = False,
        shared: int = 0,
        scale: bool = False,
        input_norm_eps: float | None = None,
        input_multiplier: float = 1.0,
        expert_scale: bool = False,
        hash_vocab: int | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")
        if input_norm_eps is not None and not (math.isfinite(input_norm_eps) and input_norm_eps > 0):
            raise ValueError(
                f"the router's input_norm_eps must be finite and > 0 (or None), got {input_norm_eps}"
            )
        if not (math.isfinite(input_multiplier) and input_multiplier > 0):
            raise ValueError(f"the router's input_multiplier must be finite and > 0, got {input_multiplier}")
        self.spec = spec or RouterSpec()
        problem = self.spec.problem(experts, top_k)
        if shared and self.spec.score != "sigmoid":
            problem = (
                f"a router scoring {shared} shared experts needs sigmoid scores, got {self.spec.score!r}"
            )
        if hash_vocab is not None and (self.spec.choice_bias or self.spec.groups > 1 or shared):
            problem = (
                f"a hash router (hash_vocab={hash_vocab}) chooses by its table: no choice bias (got "
                f"{self.spec.choice_bias}), groups (got {self.spec.groups}) or shared scores (got {shared})"
            )
        if problem:
            raise ValueError(problem)
        self.top_k, self.renormalize, self.shared = top_k, renormalize, shared
        self.weight = nn.Parameter(
            uniform((experts + shared, d_model), d_model, generator(seed, ROUTER_STREAM))
        )
        self.register_buffer("score_bias", torch.zeros(experts) if self.spec.choice_bias else None)
        self.register_buffer("tid2eid", None if hash_vocab is None else hash_table(hash_vocab, top_k))
        self.bias = nn.Parameter(torch.zeros(experts + shared)) if bias else None
        self.scale = nn.Parameter(torch.ones(1)) if scale else None
        self.input_norm_eps, self.input_multiplier = input_norm_eps, input_multiplier
        self.input_scale = None if input_norm_eps is None else nn.Parameter(torch.ones(d_model))
        self.expert_scale = nn.Parameter(torch.ones(experts)) if expert_scale else None
        self.adapters = nn.ModuleDict()  # adapter name -> RouterAdapter (`tessera.moe.adapters`)

    def forward(
        self,
        x: Tensor,
        input_ids: Tensor | None = None,
        *,
        tp_group: dist.ProcessGroup | None = None,
        carried: Tensor | None = None,
    ) -> Routing:
        x = tokens = x.reshape(-1, x.shape[-1])
        dtype = x.dtype  # the weights' unless spec.weights_float32
        weight = deltas(self.weight, (a.delta() for a in self.adapters.values()))  # type: ignore[operator]
        if self.input_scale is not None and self.input_norm_eps is not None:
            x = normalised(x, self.input_norm_eps) * self.input_scale
        if self.input_multiplier != 1.0:
            x = x * self.input_multiplier
        if self.spec.float32:  # DeepSeek-V3's F.linear(x.float(), weight.float()), in any dtype
            x, weight = x.float(), weight.float()
        logits = x @ weight.t() if self.bias is None else F.linear(x, weight, self.bias.to(weight.dtype))
        chosen = None
        if self.tid2eid is not None:
            chosen = hash_choices(self.tid2eid, input_ids, x.shape[0], logits.shape[-1] - self.shared)
        routing = route(
            logits,
            self.top_k,
            renormalize=self.renormalize,
            spec=self.spec,
            bias=self.score_bias,
            shared=self.shared,
            chosen=chosen,
        )
        if self.expert_scale is not None:
            routing = replace(routing, weights=routing.weights * self.expert_scale[routing.choices])
        if self.scale is not None:
            shared = routing.shared_weights
            routing = replace(
                routing,
                weights=routing.weights * self.scale,
                shared_weights=None if shared is None else shared * self.scale,
            )
        if self.spec.weights_float32:  # Mixtral's: its experts weigh their bf16 outputs in fp32
            return replace(routing, inputs=tokens)
        return replace(routing, weights=routing.weights.to(dtype), inputs=tokens)  # Qwen's .to(logits.dtype)
