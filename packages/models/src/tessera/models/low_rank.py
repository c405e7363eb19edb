"""A user's own LoRA layer in PEFT's layout, for tests: ``LowRank`` wraps a ``base_layer`` with
``lora_A`` / ``lora_B`` ModuleDicts of ``nn.Linear`` and a ``scaling`` per adapter, and adds
``scaling[k] * lora_B[k](lora_A[k](x))`` to the base layer's output; ``with_low_rank`` puts one
on every ``nn.Linear`` of a model whose name is among ``targets``. PEFT is not used: Tessera
reads adapters by this layout, whoever wrote them."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

__all__ = ["LowRank", "with_low_rank"]


class LowRank(nn.Module):
    """``base(x) + sum_k scaling[k] * B_k(A_k(x))``; A and B drawn (std 0.2) from a generator
    seeded ``seed`` (not the global one: ranks may be threads)."""

    def __init__(self, base: nn.Linear, rank: int, adapters: Iterable[str], seed: int) -> None:
        super().__init__()
        names = list(adapters)
        gen = torch.Generator().manual_seed(seed)
        self.base_layer = base
        self.lora_A = nn.ModuleDict({k: nn.Linear(base.in_features, rank, bias=False) for k in names})
        self.lora_B = nn.ModuleDict({k: nn.Linear(rank, base.out_features, bias=False) for k in names})
        self.lora_dropout = nn.ModuleDict({k: nn.Identity() for k in names})
        self.scaling = {k: 2.0 / (i + 1) for i, k in enumerate(names)}
        with torch.no_grad():
            for p in [*self.lora_A.parameters(), *self.lora_B.parameters()]:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.base_layer(x)
        for k, a in self.lora_A.items():
            y = y + self.lora_B[k](a(self.lora_dropout[k](x))) * self.scaling[k]
        return y


def with_low_rank(
    model: nn.Module, targets: Iterable[str], *, rank: int = 4, adapters: Iterable[str] = ("default",)
) -> nn.Module:
    """``model`` with a `LowRank` on every ``nn.Linear`` named one of ``targets`` (the last
    component of its name), each seeded by its position; returns the model."""
    wanted, names = set(targets), list(adapters)
    for i, (name, module) in enumerate(list(model.named_modules())):
        parent, _, child = name.rpartition(".")
        if child in wanted and isinstance(module, nn.Linear):
            setattr(model.get_submodule(parent), child, LowRank(module, rank, names, seed=i))
    return model
