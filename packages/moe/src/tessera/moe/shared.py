"""The shared experts of a mixture-of-experts layer: MLPs every token goes through.

A layer's shared bank (`tessera.moe.Experts`, ``shared``) holds ``S`` shared experts of one
width (one by default), each run on every token of the call (on every ep rank, on its own
tokens; under tp each rank runs its share of every one's hidden units, like the routed
experts'), and their outputs summed. How much each contributes:

- nothing further (DeepSeek's, most): their outputs as they are;
- a sigmoid gate (``shared_gate [1, d]``, Qwen2-MoE): the sum scaled per token by
  ``sigmoid(x @ shared_gate.T)``;
- weights from the router (``shared_scores``, Inkling's "shared gammas"): the router holds a
  logit per shared expert beside the routed ones and weighs each shared expert per token with
  its share of the renormalisation over the chosen and the shared experts together
  (`tessera.moe.router`); the router's gradient then comes back through the shared experts too.
  The weights are whole on every tp rank and multiply each rank's share of an output: the sum
  over tp is the weighted whole, and the router's gradient a partial sum, as for the routed
  experts.

A shared bank may normalise each shared expert's output (``norm_eps``, Ergo's shared expert:
`tessera.moe.norms`) before it is weighed; as for the routed experts, tp refuses it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tessera.moe.experts import Experts

__all__ = ["shared_output"]


def shared_output(bank: Experts, tokens: Tensor, gate: Tensor | None, weights: Tensor | None) -> Tensor:
    """The shared experts' contribution for ``tokens [T, d]`` (module docstring): each of the
    bank's experts on every token, times its column of ``weights [T, S]`` when given, summed,
    scaled by ``sigmoid(tokens @ gate.T)`` when ``gate [1, d]`` is given."""
    if weights is not None and weights.shape != (tokens.shape[0], bank.count):
        raise ValueError(
            f"shared weights {tuple(weights.shape)} must be [tokens={tokens.shape[0]}, shared={bank.count}]"
        )
    out: Tensor | None = None
    for s in range(bank.count):
        y = bank.expert(s, tokens)
        if weights is not None:
            y = y * weights[:, s : s + 1].to(y.dtype)
        out = y if out is None else out + y
    assert out is not None  # a bank holds at least one expert
    return out if gate is None else torch.sigmoid(tokens @ gate.t()) * out
