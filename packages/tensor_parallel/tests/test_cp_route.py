"""Tier 0 and 1: what ``route_attention`` routes, what it refuses, and what it leaves alone.

Ranks are threads (Ulysses: all-to-all only, no send/recv). Tier 0: ``causal_of`` reads a
mask as causal, full or general. Tier 1: a mask that is exactly causal routes as causal; an
attention call the modes cannot serve (another mask, dropout, cross-attention) and a model
they cannot serve (no SDPA called, a learned position embedding not named, routed twice)
raise ValueError naming what was passed, before any collective; SDPA called outside the
model's forward, or on another thread while it runs, is the plain function; a layer
recomputed by activation checkpointing is routed again. Outputs and gradients against the
serial model: fp32, rtol 1e-5, atol 1e-6 (attention on another layout and gradients summed
over 2 ranks: round-off, measured <= 5e-7 on values up to ~12).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tessera.comm import CommMeter
from tessera.comm.testing import run_threaded
from tessera.models.foreign import ForeignConfig, GPT2ish, Llamaish
from tessera.tensor_parallel.context import route_attention, split_batch, split_sequence
from tessera.tensor_parallel.context.intercept import causal_of

TOL = {"rtol": 1e-5, "atol": 1e-6}
HEADS, DIM, SEQ = 2, 8, 8


def test_causal_of_reads_masks() -> None:
    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    additive = torch.zeros(4, 4).masked_fill(~tril, torch.finfo(torch.float32).min)
    assert causal_of(tril, 4, 4) is True
    assert causal_of(tril.expand(2, 1, 4, 4), 4, 4) is True
    assert causal_of(additive, 4, 4) is True
    assert causal_of(torch.ones(4, 4, dtype=torch.bool), 4, 4) is False
    assert causal_of(torch.zeros(1, 1, 1, 4), 4, 4) is False
    padded = tril.clone()
    padded[:, 0] = False
    assert causal_of(padded, 4, 4) is None
    assert causal_of(additive.masked_fill(~tril, -1.0), 4, 4) is None  # a bias, not a mask
    assert causal_of(torch.ones(4, 4, dtype=torch.long), 4, 4) is None


class Attend(nn.Module):
    """q, k, v from one linear; SDPA called with whatever ``kwargs`` (or ``mask(len)``) say."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.qkv = nn.Linear(HEADS * DIM, 3 * HEADS * DIM)
        self.kwargs = kwargs

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)
        kwargs = dict(self.kwargs)
        if callable(kwargs.get("attn_mask")):
            kwargs["attn_mask"] = kwargs["attn_mask"](s)
        if kwargs.pop("cross", False):
            k, v = k[:, :, :1], v[:, :, :1]
        y = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return x + y.transpose(1, 2).reshape(b, s, HEADS * DIM)  # type: ignore[no-any-return]


def _attend(**kwargs: Any) -> nn.Module:
    model = nn.Sequential(Attend(**kwargs), Attend(**kwargs))
    gen = torch.Generator().manual_seed(0)  # not the global generator: ranks are threads
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def _x() -> Tensor:
    return torch.randn(2, SEQ, HEADS * DIM, generator=torch.Generator().manual_seed(1))


def _checkpoint_layers(model: nn.Module) -> None:
    """As ``tessera.launcher``'s recompute does: each layer's forward replaced by a
    checkpoint of it (each ``Attend`` calls SDPA in its own forward)."""
    for layer in model.children():
        original = layer.forward

        def forward(x: Tensor, _original: Any = original) -> Any:
            return checkpoint(_original, x, use_reentrant=False)

        layer.forward = forward  # type: ignore[method-assign]


def _run(rank: int, kwargs: dict[str, Any], ckpt: bool) -> Tensor:
    model = route_attention(_attend(**kwargs), None, mode="ulysses", layout="zigzag")
    if ckpt:
        _checkpoint_layers(model)
    (x,) = split_batch(_x(), group=None, layout="zigzag")
    x.requires_grad_(True)
    out = model(x)
    out.square().sum().backward()
    assert x.grad is not None
    return torch.cat([out.detach(), x.grad])


def _serial(kwargs: dict[str, Any], rank: int) -> Tensor:
    x = _x().requires_grad_(True)
    out = _attend(**kwargs)(x)
    out.square().sum().backward()
    assert x.grad is not None
    return torch.cat([split_sequence(t, rank, 2, "zigzag") for t in (out.detach(), x.grad)])


def _tril(n: int) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


@pytest.mark.parametrize(
    ("kwargs", "ckpt"),
    [({"is_causal": True}, False), ({}, False), ({"attn_mask": _tril}, False), ({"is_causal": True}, True)],
    ids=["causal", "full", "causal-mask", "checkpointed"],
)
def test_routed_calls_equal_serial(kwargs: dict[str, Any], ckpt: bool) -> None:
    """Outputs and input gradients of each rank's slice; the local causal mask means causal."""
    for rank, got in enumerate(run_threaded(2, _run, kwargs, ckpt)):
        torch.testing.assert_close(got, _serial(kwargs, rank), **TOL)


def _refusal(rank: int, build: Any, positions: str | None) -> list[str]:
    with CommMeter() as meter:
        try:
            model = route_attention(build(), None, mode="ulysses", positions=positions)
            model(torch.randint(0, 8, (2, SEQ)) if isinstance(model, GPT2ish) else _x())
            message = "no error"
        except ValueError as e:
            message = str(e)
    return [message, f"{meter.count()} calls"]


PADDING = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
PADDING[:, 0] = False
SMALL = ForeignConfig(vocab=8, dim=16, heads=2, kv_heads=2, layers=1, hidden=16, max_len=SEQ)


@pytest.mark.parametrize(
    ("build", "positions", "message"),
    [
        (
            lambda: _attend(attn_mask=lambda s: PADDING),
            None,
            "context parallelism supports causal attention (is_causal=True, or a mask that is exactly "
            "causal) or no mask; scaled_dot_product_attention got attn_mask=a torch.bool tensor of "
            "shape (8, 8), is_causal=False",
        ),
        (
            lambda: _attend(is_causal=True, dropout_p=0.1),
            None,
            "context parallelism does not support attention dropout: dropout_p=0.1 (set it to 0, or pass it "
            "only in eval)",
        ),
        (
            lambda: _attend(cross=True),
            None,
            "context parallelism needs self-attention over the local sequence: query length 8 != key "
            "length 1 (a KV cache or cross-attention is not supported)",
        ),
        (
            lambda: nn.Linear(HEADS * DIM, HEADS * DIM),
            None,
            "context parallelism found no attention: the model's forward called no "
            "torch.nn.functional.scaled_dot_product_attention (an eager or custom attention cannot be split; "
            "call SDPA, or name parameter-free cores with cores=...)",
        ),
        (
            lambda: GPT2ish(SMALL),
            None,
            "wpe looks like a position embedding (called with 0..7) but does not follow the sequence shards: "
            "name it in positions= (ModelSpec.positions)",
        ),
        (lambda: GPT2ish(SMALL), "pos", "positions pattern 'pos' matches no module of GPT2ish"),
        (lambda: route_attention(_attend(), None), None, "Sequential is already context-parallel"),
    ],
    ids=["padding-mask", "dropout", "cross", "no-sdpa", "unnamed-positions", "bad-pattern", "twice"],
)
def test_what_cannot_be_routed_is_refused_before_communicating(
    build: Any, positions: str | None, message: str
) -> None:
    for got in run_threaded(2, _refusal, build, positions):
        assert got == [message, "0 calls"]


def _bystanders(rank: int) -> list[bool]:
    """SDPA outside the forward, and on another thread during it, is the plain function."""
    q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(2))
    plain = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    seen: list[Tensor] = []

    def elsewhere(module: nn.Module, args: Any) -> None:
        t = threading.Thread(
            target=lambda: seen.append(F.scaled_dot_product_attention(q, q, q, is_causal=True))
        )
        t.start()
        t.join()

    model = route_attention(_attend(is_causal=True), None, mode="ulysses")
    model[1].register_forward_pre_hook(elsewhere)
    (x,) = split_batch(_x(), group=None)
    model(x)
    after = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    return [torch.equal(seen[0], plain), torch.equal(after, plain)]


def test_other_callers_see_plain_sdpa() -> None:
    assert run_threaded(2, _bystanders) == [[True, True]] * 2


def _llamaish_grads(rank: int) -> dict[str, Tensor]:
    model = route_attention(Llamaish(SMALL, seed=0), None, mode="ulysses", layout="zigzag")
    (ids,) = split_batch(torch.arange(2 * SEQ).view(2, SEQ) % 7, group=None, layout="zigzag")
    model(ids).square().sum().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_rotary_is_found_by_class_and_follows_the_shards() -> None:
    """Llamaish names nothing: its ``Rotary`` modules are hooked; summed gradients = serial."""
    serial = Llamaish(SMALL, seed=0)
    serial(torch.arange(2 * SEQ).view(2, SEQ) % 7).square().sum().backward()
    ranks = run_threaded(2, _llamaish_grads)
    for name, p in serial.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(ranks[0][name] + ranks[1][name], p.grad, **TOL)
