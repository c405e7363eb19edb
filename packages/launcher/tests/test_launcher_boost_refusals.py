"""Tier 0: what ``boost()`` refuses about the model's optimizer, in one line naming the
parameters, before it builds any process group (these tests initialise none)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.launcher import boost
from tessera.launcher.config.boost_config import BoostConfig, ParallelConfig


class Classifier(nn.Module):
    """Not a language model: features in, class scores out."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.scores = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.scores(h)


CONFIG = BoostConfig(parallel=ParallelConfig(dp=2))


def test_an_optimizer_missing_a_trainable_parameter_is_named() -> None:
    model = Classifier()
    model.stem.requires_grad_(False)  # frozen: the optimizer need not hold it
    params = [p for n, p in model.named_parameters() if p.requires_grad and n != "blocks.1.weight"]
    with pytest.raises(
        ValueError, match=r"missing \['blocks\.1\.weight'\], 0 held twice, 0 not in the model"
    ):
        boost(model, torch.optim.SGD(params, lr=0.1), CONFIG)


def test_a_parameter_outside_the_model_is_counted() -> None:
    model = Classifier()
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"missing \[\], 0 held twice, 1 not in the model"):
        boost(model, torch.optim.SGD([*model.parameters(), stray], lr=0.1), CONFIG)
