"""Mixture-of-experts models written the way a user writes one, in plain PyTorch.

``Mixish`` is ``Llamaish`` (``tessera.models.foreign``) with each layer's MLP replaced by a
sparse mixture under the user's own names: ``layers.*.moe`` holds a router ``gate`` (a
bias-free ``Linear(dim, experts)``), ``experts`` (an ``nn.ModuleList`` of SwiGLU MLPs named
``gate_proj`` / ``up_proj`` / ``down_proj``) and, when asked, an always-on
``shared_expert`` of the same kind. Routing: softmax over the experts in fp32, the top
``top_k`` per token, their weights renormalised to sum to 1 (``norm_topk``), every token
kept (no capacity); the experts run one by one on the tokens that chose them.

Each block records its load-balancing loss in ``balance_loss`` (Switch: ``E * sum_e f_e *
P_e``, ``f_e`` the fraction of the ``T * k`` choices that went to expert ``e``, ``P_e`` its
mean router probability) during its forward; the model's ``aux_loss()`` sums them, as users'
training loops read it (``loss = entropy + coef * model.aux_loss()``).

``Seekish`` is the same model with DeepSeek-V3's routing, again under the user's own names
and in the user's own code (``layers.*.moe``: a bias-free ``router``, a buffer ``gate_bias``,
``experts`` and a ``shared_expert``): sigmoid scores; ``gate_bias`` (auxiliary-loss-free
balancing: moved between steps by the user's loop, never by a gradient) added to them to
choose the experts, never to weigh them; each token keeps the ``keep_groups`` best of
``groups`` groups of consecutive experts (a group's score: the sum of its two best biased
scores) and chooses its ``top_k`` experts in them; the chosen scores renormalised to sum to 1
and multiplied by ``scale``; the always-on shared expert added. It has no auxiliary loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.models.foreign import GQA, ForeignConfig, RMSNorm, _init

__all__ = ["MIXISH_ROLES", "MixConfig", "Mixish", "SeekConfig", "Seekish"]

# The plan of roles a user writes for Mixish (and Seekish): the attention split as Llamaish's, each mixture
# replicated (under tensor parallelism every tp rank runs the whole mixture on the same tokens).
MIXISH_ROLES: dict[str, str] = {
    "tok_embeddings": "vocab",
    "layers.*.attn_norm": "norm",
    "layers.*.attn": "attention",
    "layers.*.attn.wq": "colwise",
    "layers.*.attn.wk": "colwise",
    "layers.*.attn.wv": "colwise",
    "layers.*.attn.wo": "rowwise",
    "layers.*.moe_norm": "norm",
    "layers.*.moe": "replicate",
    "norm": "norm",
    "output": "head",
}


_BASE = ForeignConfig(vocab=64, dim=32, heads=4, kv_heads=2, layers=2, hidden=24, max_len=32)


@dataclass(frozen=True, slots=True)
class MixConfig:
    """``Mixish``'s sizes: ``base`` the Llamaish sizes (its ``hidden`` each expert's width),
    ``experts`` and ``top_k`` the mixture, ``shared`` the shared expert's width (0: none)."""

    base: ForeignConfig = _BASE
    experts: int = 4
    top_k: int = 2
    norm_topk: bool = True
    shared: int = 0


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class SparseMoE(nn.Module):
    def __init__(self, c: MixConfig) -> None:
        super().__init__()
        d = c.base.dim
        self.num_experts, self.top_k, self.norm_topk = c.experts, c.top_k, c.norm_topk
        self.gate = nn.Linear(d, c.experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, c.base.hidden) for _ in range(c.experts))
        self.shared_expert = Expert(d, c.shared) if c.shared else None
        self.balance_loss = torch.zeros(())

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(tokens).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out = out.index_add(
                    0, rows, expert(tokens[rows]) * weights[rows, slot][:, None].to(tokens.dtype)
                )
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts).to(probs.dtype)
        self.balance_loss = self.num_experts * torch.dot(counts / counts.sum(), probs.mean(dim=0))
        return out.view(x.shape)


@dataclass(frozen=True, slots=True)
class SeekConfig:
    """``Seekish``'s sizes: ``base`` the Llamaish sizes (its ``hidden`` each expert's width),
    ``experts`` in ``groups`` groups of which a token keeps ``keep_groups``, ``top_k``, the
    routed weights' ``scale`` and the shared expert's width ``shared``."""

    base: ForeignConfig = _BASE
    experts: int = 8
    top_k: int = 2
    groups: int = 4
    keep_groups: int = 2
    scale: float = 2.5
    shared: int = 16


class BiasedMoE(nn.Module):
    gate_bias: Tensor

    def __init__(self, c: SeekConfig) -> None:
        super().__init__()
        d = c.base.dim
        self.top_k, self.groups, self.keep_groups, self.scale = c.top_k, c.groups, c.keep_groups, c.scale
        self.router = nn.Linear(d, c.experts, bias=False)
        self.register_buffer("gate_bias", torch.zeros(c.experts))
        self.experts = nn.ModuleList(Expert(d, c.base.hidden) for _ in range(c.experts))
        self.shared_expert = Expert(d, c.shared)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores = torch.sigmoid(self.router(tokens).float())
        biased = (scores + self.gate_bias).view(len(tokens), self.groups, -1)  # the bias only chooses
        group_scores = biased.topk(2, dim=-1).values.sum(dim=-1)
        worst = group_scores.argsort(dim=-1)[:, : self.groups - self.keep_groups]
        biased = biased.scatter(1, worst[..., None].expand(-1, -1, biased.shape[-1]), float("-inf"))
        chosen = biased.flatten(1).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        weights = self.scale * weights / weights.sum(dim=-1, keepdim=True)
        out: Tensor = self.shared_expert(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out = out.index_add(
                    0, rows, expert(tokens[rows]) * weights[rows, slot, None].to(tokens.dtype)
                )
        return out.view(x.shape)


class MixLayer(nn.Module):
    def __init__(self, base: ForeignConfig, moe: nn.Module) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(base.dim), GQA(base)
        self.moe_norm, self.moe = RMSNorm(base.dim), moe

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        out: Tensor = x + self.moe(self.moe_norm(x))
        return out


class _Mixture(nn.Module):
    """``tok_embeddings``, ``layers`` (attn_norm, attn, moe_norm, moe: one of ``blocks()``),
    ``norm``, ``output``, initialised from ``seed``."""

    def __init__(self, base: ForeignConfig, blocks: Callable[[], nn.Module], seed: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(base.vocab, base.dim)
        self.layers = nn.ModuleList(MixLayer(base, blocks()) for _ in range(base.layers))
        self.norm = RMSNorm(base.dim)
        self.output = nn.Linear(base.dim, base.vocab, bias=False)
        _init(self, seed)

    def blocks(self) -> list[nn.Module]:
        """Each layer's mixture."""
        return [cast(MixLayer, layer).moe for layer in self.layers]

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        out: Tensor = self.output(self.norm(h))
        return out


class Mixish(_Mixture):
    """``tok_embeddings``, ``layers`` (attn_norm, attn, moe_norm, moe), ``norm``, ``output``;
    ``aux_loss()`` the sum of the blocks' ``balance_loss`` from the last forward."""

    def __init__(self, c: MixConfig = MixConfig(), *, seed: int = 0) -> None:
        super().__init__(c.base, lambda: SparseMoE(c), seed)
        self.config = c
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():  # routers of order 1, so no two experts' scores are near a tie
            for block in self.blocks():
                gate = cast(SparseMoE, block).gate.weight
                gate.copy_(torch.randn(gate.shape, generator=gen))

    def aux_loss(self) -> Tensor:
        """The blocks' load-balancing losses of the last forward, summed."""
        total = torch.zeros(())
        for block in self.blocks():
            total = total + cast(SparseMoE, block).balance_loss
        return total


class Seekish(_Mixture):
    """``Mixish`` with DeepSeek-V3's routing (module docstring): ``layers.*.moe`` holds
    ``router``, ``gate_bias``, ``experts`` and ``shared_expert``."""

    def __init__(self, c: SeekConfig = SeekConfig(), *, seed: int = 0) -> None:
        super().__init__(c.base, lambda: BiasedMoE(c), seed)
        self.config = c
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for block in self.blocks():
                moe = cast(BiasedMoE, block)
                # logits of order 2, whose sigmoids spread over (0, 1); a bias of order 0.1, as a
                # balancing run might have left it, that changes many choices
                moe.router.weight.copy_(
                    torch.randn(moe.router.weight.shape, generator=gen) * 2 / c.base.dim**0.5
                )
                moe.gate_bias.copy_(torch.randn(c.experts, generator=gen) * 0.1)
