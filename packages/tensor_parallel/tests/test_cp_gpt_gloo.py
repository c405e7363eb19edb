"""Tier 2: the reference GPT made context-parallel (cp=2, gloo) trains like the serial GPT.

``context_parallelize`` swaps the attention cores and offsets the position embedding; each
rank gets its slice of every batch (``split_batch``), the loss is the exact global mean
(``context_parallel_loss``) and gradients are summed over cp (``sync_context_parallel_grads``).
Compared with the serial GPT under SGD: the loss of every step, every gradient of the first
step and every weight after the last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.models import GPT, GPTConfig, make_batch
from tessera.tensor_parallel.context import (
    context_parallel_loss,
    context_parallelize,
    split_batch,
    sync_context_parallel_grads,
)

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
STEPS, LR = 3, 0.5
# fp32. Losses (~4.2): the global mean is a sum over 2 ranks' partial sums instead of one
# mean, a few ulp apart (measured <= 5e-7). Gradients (up to ~0.2) and SGD weights:
# attention sums over blocks merged by log-sum-exp and parameter gradients are sums of 2
# ranks' partial sums, so they differ from serial by fp32 round-off (measured <= 6e-8); a
# missing position offset, a wrong mask or an unsummed gradient is off by >1e-3.
LOSS_TOL = {"rtol": 1e-6, "atol": 1e-5}
TOL = {"rtol": 1e-5, "atol": 1e-6}


StepLoss = Callable[[nn.Module, Tensor, Tensor], Tensor]


def _train(
    model: nn.Module, step_loss: StepLoss, after_backward: Callable[[nn.Module], object]
) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        loss = step_loss(model, *make_batch(CFG, 4, seed=step))
        loss.backward()
        after_backward(model)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "weights": {n: p.detach() for n, p in model.named_parameters()}}


def _cp_train(rank: int, mode: str, layout: str) -> dict[str, Any]:
    def step_loss(model: nn.Module, idx: Tensor, targets: Tensor) -> Tensor:
        idx, targets = split_batch(idx, targets, group=None, layout=layout)
        return context_parallel_loss(model(idx), targets, None)

    model = context_parallelize(GPT(CFG, seed=0), None, mode=mode, layout=layout)
    return _train(model, step_loss, lambda m: sync_context_parallel_grads(m, None))


@pytest.mark.parametrize(
    ("mode", "layout"), [("ring", "contiguous"), ("ring", "zigzag"), ("ulysses", "zigzag")]
)
def test_context_parallel_gpt_trains_like_serial(worker_pools: PoolFactory, mode: str, layout: str) -> None:
    """Losses of 3 SGD steps, first-step gradients, final weights; LOSS_TOL / TOL above."""
    serial = _train(GPT(CFG, seed=0), lambda m, idx, targets: m.loss(idx, targets), lambda m: None)  # type: ignore[operator]
    for got in worker_pools(2).run(_cp_train, mode, layout):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(serial["losses"]), **LOSS_TOL)
        for part in ("grads", "weights"):
            assert got[part].keys() == serial[part].keys()
            for name, want in serial[part].items():
                torch.testing.assert_close(got[part][name], want, **TOL)
