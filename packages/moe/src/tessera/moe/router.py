"""The top-k router: a bias-free linear map to one logit per expert, softmax, top-k."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tessera.moe.init import ROUTER_STREAM, generator, uniform

__all__ = ["Routing", "TopKRouter", "route"]


@dataclass(frozen=True, slots=True)
class Routing:
    """One call's routing of ``T`` tokens over ``E`` experts.

    ``logits`` and ``probs``: ``[T, E]`` (probs in fp32, softmax of the logits);
    ``choices``: ``[T, k]`` expert indices, highest probability first; ``weights``:
    ``[T, k]`` their combine weights (the probabilities, renormalised to sum to 1 per
    token when asked).
    """

    logits: Tensor
    probs: Tensor
    choices: Tensor
    weights: Tensor


def route(logits: Tensor, top_k: int, *, renormalize: bool) -> Routing:
    """Softmax over experts (in fp32), then each token's ``top_k`` experts and weights."""
    experts = logits.shape[-1]
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, choices = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(logits=logits, probs=probs, choices=choices, weights=weights)


class TopKRouter(nn.Module):
    """``x [T, d] -> Routing``: logits ``x @ weight.T`` (``weight [E, d]``, no bias).

    Initialised uniformly in ``±1/sqrt(d)`` from stream 0 of ``seed`` (`tessera.moe.init`). Under expert
    parallelism every rank holds the same router (a data-parallel parameter).
    """

    def __init__(self, d_model: int, experts: int, top_k: int, *, renormalize: bool, seed: int) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(uniform((experts, d_model), d_model, generator(seed, ROUTER_STREAM)))

    def forward(self, x: Tensor) -> Routing:
        return route(x @ self.weight.t(), self.top_k, renormalize=self.renormalize)
