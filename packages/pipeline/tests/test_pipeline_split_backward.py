"""Tier 0: the B/W split of one stage's backward equals one full backward (no processes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.models import GPT, GPTConfig, make_batch
from tessera.pipeline import split_backward
from tessera.pipeline.split_backward import backward_input, grad_nodes

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=3)


class Twice(nn.Module):
    """One linear layer applied twice (a weight shared along the input path), plus a skip."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(CFG.d_model, CFG.d_model)
        self.scale = nn.Parameter(torch.ones(CFG.d_model))

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.tanh(self.lin(x))) * self.scale + x  # type: ignore[no-any-return]


class Ignores(nn.Module):
    """An output that does not depend on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(CFG.d_model))

    def forward(self, x: Tensor) -> Tensor:
        return self.bias.expand_as(x) * 2


def full_and_split(stage: nn.Module, x: Tensor, loss: bool, nodes: bool) -> None:
    torch.manual_seed(0)
    params = list(stage.parameters())
    y = stage(x)
    if loss:
        y = F.cross_entropy(y.flatten(0, -2), make_batch(CFG, x.shape[0], seed=1)[1].flatten())
    grad = torch.full_like(y, 0.5) if loss else torch.randn_like(y)
    wants_dx = x.requires_grad
    inputs = ([x] if wants_dx else []) + params
    want = torch.autograd.grad(y, inputs, grad, retain_graph=True, allow_unused=True, materialize_grads=True)
    dx, weights = backward_input(y, grad, x, params, grad_nodes(params) if nodes else None)
    for p in params:
        assert p.grad is None, "B must not touch the weight gradients"
    weights.run()
    if wants_dx:
        assert dx is not None
        torch.testing.assert_close(dx, want[0], atol=1e-6, rtol=1e-6)
    else:
        assert dx is None
    for p, g in zip(params, want[1:] if wants_dx else want, strict=True):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("nodes", [False, True])
@pytest.mark.parametrize("which", ["layers", "layers+head+loss", "embed+layer", "twice", "ignores"])
def test_split_equals_full(which: str, nodes: bool) -> None:
    blocks = GPT(CFG, seed=0).blocks()
    x = torch.randn(2, CFG.seq_len, CFG.d_model, requires_grad=True)
    stage: nn.Module
    if which == "layers":
        stage, loss = nn.Sequential(*blocks[1:3]), False
    elif which == "layers+head+loss":
        stage, loss = nn.Sequential(*blocks[2:]), True
    elif which == "embed+layer":  # no differentiable input: W runs the whole backward
        stage, loss = nn.Sequential(*blocks[:2]), False
        x = make_batch(CFG, 2, seed=0)[0]
    elif which == "twice":
        stage, loss = Twice(), False
    else:
        stage, loss = Ignores(), False
    full_and_split(stage, x, loss, nodes)


@pytest.mark.parametrize("which", ["layers", "layers+head+loss", "twice"])
def test_split_without_input_metadata(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback for a torch whose nodes hide ``_input_metadata`` (pre-hooks keep the
    frontier gradients) equals the full backward too, to the tolerance of `full_and_split`."""
    monkeypatch.setattr(split_backward, "_num_slots", lambda node: None)
    test_split_equals_full(which, nodes=True)


def test_weight_grads_accumulate() -> None:
    stage = nn.Sequential(*GPT(CFG, seed=0).blocks()[1:3])
    params = list(stage.parameters())
    x = torch.randn(2, CFG.seq_len, CFG.d_model, requires_grad=True)
    grads = [torch.randn(2, CFG.seq_len, CFG.d_model) for _ in range(2)]
    for g in grads:
        stage(x).backward(g)
    want = [p.grad.clone() for p in params if p.grad is not None]
    stage.zero_grad(set_to_none=True)
    pending = [backward_input(stage(x), g, x, params)[1] for g in grads]
    for w in reversed(pending):  # W's may run in any order after their B's
        w.run()
    for p, g in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-6)
