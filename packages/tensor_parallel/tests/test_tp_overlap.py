"""The overlapped tp region (``overlap``): the same results as the serial layers, in the order
that lets the all-reduces run beside computation.

Tier 1 (threaded ranks). Hypothesis draws the shapes, tp, bias, sequence parallelism and the
row layers' number of pieces; the region holds two column layers reading its input (q and k, say) and a column
layer reading something else, followed by a row layer. Each rank's output, input gradient and
weight gradients must equal the serial ones' slices. Tolerance: fp32 round-off (the tp sums
and the pieces' weight gradients reorder fp32 additions): rtol 1e-5, atol 1e-5 of the largest
value or of 1, the size of the summands (a sum can cancel to near zero, its round-off not).

The order is checked by recording, during backward, when each weight gradient lands and when
the input-gradient all-reduce is started and waited: every weight gradient of the deferred
layers arrives between the two. A backward that asks only for the input gradient (what
zero-bubble's input pass does) computes no weight gradient, and a later backward for the
weights (its weight pass) still gets them all.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm import group_rank, group_size
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    overlap,
    seeded_linear,
    set_overlap,
    sync_sequence_parallel_grads,
)
from tessera.tensor_parallel.layers import end_region, enter_region_of

_LOCK = threading.Lock()


class _Region(nn.Module):
    """A region: ``a`` and ``b`` read its input, ``c`` reads ``tanh`` of it (so it keeps the
    plain path, and the input gradient is a sum of linear and other terms), ``out`` sums the
    products back."""

    def __init__(self, d: int, h: int, bias: bool, sp: bool = False) -> None:
        super().__init__()
        self.sp = sp
        self.a = ColumnParallelLinear(d, h, group=None, bias=bias, enter_region=False, seed=1)
        self.b = ColumnParallelLinear(d, h, group=None, bias=bias, enter_region=False, seed=2)
        self.c = ColumnParallelLinear(d, h, group=None, bias=bias, enter_region=False, seed=3)
        self.out = RowParallelLinear(
            h, d, group=None, bias=bias, input_is_parallel=True, sequence_parallel=sp, seed=4
        )

    def forward(self, x: Tensor) -> Tensor:
        inner = [self.a, self.b, self.c]
        x = enter_region_of(inner, x, None, sequence_parallel=self.sp, private=False)
        a = self.a(x)
        y = a * self.b(x)
        y = y + self.c(torch.tanh(x))  # c reads another tensor: the plain path
        end_region(inner)
        return self.out(y)  # type: ignore[no-any-return]


def _serial(d: int, h: int, bias: bool, x: Tensor, w: Tensor) -> dict[str, Tensor]:
    a, b, c = (seeded_linear(i, o, bias=bias, seed=s) for i, o, s in ((d, h, 1), (d, h, 2), (d, h, 3)))
    out = seeded_linear(h, d, bias=bias, seed=4)
    x = x.clone().requires_grad_(True)
    ya = a(x)
    y = out(ya * b(x) + c(torch.tanh(x)))
    (y * w).sum().backward()
    grads = {"y": y.detach(), "x": x.grad}
    for name, layer in (("a", a), ("b", b), ("c", c), ("out", out)):
        for pname, p in layer.named_parameters():
            grads[f"{name}.{pname}"] = p.grad
    return grads  # type: ignore[return-value]


def _parallel(
    rank: int, d: int, h: int, bias: bool, sp: bool, chunks: int, x: Tensor, w: Tensor
) -> dict[str, Any]:
    module = _Region(d, h, bias, sp)
    set_overlap(module, True, chunks=chunks)
    if sp:  # this rank's slice of the sequence
        x, w = (t.chunk(group_size(None), dim=-2)[rank] for t in (x, w))
    x = x.clone().requires_grad_(True)
    y = module(x)
    (y * w).sum().backward()
    sync_sequence_parallel_grads(module, None)
    got: dict[str, Any] = {"y": y.detach(), "x": x.grad, "tp": group_size(None), "rank": group_rank(None)}
    for name, p in module.named_parameters():
        got[name] = p.grad
    return got


def _close(got: Tensor, want: Tensor) -> None:
    # the floor 1: a gradient summed over tokens can cancel to near zero, but its round-off
    # is that of its summands, which are O(1) here (unit normal inputs and output weights)
    scale = max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


@settings(max_examples=12, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4]),
    batch=st.integers(1, 3),
    seq=st.integers(1, 5),
    d=st.sampled_from([4, 8]),
    h_per=st.integers(1, 3),
    bias=st.booleans(),
    sp=st.booleans(),
    chunks=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_an_overlapped_region_equals_the_serial_layers(
    tp: int, batch: int, seq: int, d: int, h_per: int, bias: bool, sp: bool, chunks: int, seed: int
) -> None:
    """With sequence parallelism each rank holds seq positions of the input and output (seq
    drawn per rank), and the row layer's bias gradient is summed by
    ``sync_sequence_parallel_grads``."""
    h = h_per * tp
    seq = seq * tp if sp else seq
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(batch, seq, d, generator=gen), torch.randn(batch, seq, d, generator=gen)
    want = _serial(d, h, bias, x, w)
    for got in run_threaded(tp, _parallel, d, h, bias, sp, chunks, x, w):
        lo, hi = got["rank"] * h_per, (got["rank"] + 1) * h_per
        part = seq // tp
        rows = slice(got["rank"] * part, (got["rank"] + 1) * part) if sp else slice(None)
        _close(got["y"], want["y"][:, rows])
        _close(got["x"], want["x"][:, rows])
        for name in ("a", "b", "c"):
            _close(got[f"{name}.weight"], want[f"{name}.weight"][lo:hi])
            if bias:
                _close(got[f"{name}.bias"], want[f"{name}.bias"][lo:hi])
        _close(got["out.weight"], want["out.weight"][:, lo:hi])
        if bias:
            _close(got["out.bias"], want["out.bias"])


def _ordered(rank: int, events: list[tuple[int, str]]) -> None:
    module = _Region(8, 8, True)
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: _note(events, rank, name))
    module(torch.ones(2, 3, 8).requires_grad_(True)).sum().backward()


def _note(events: list[tuple[int, str]], rank: int, what: str) -> None:
    with _LOCK:
        events.append((rank, what))


def test_weight_gradients_land_while_the_all_reduce_is_in_flight(monkeypatch: Any) -> None:
    """Per rank (tp=2): a.* and b.* land after the region's all-reduce starts and before it is
    waited for; out.* (the row layer, earlier in backward) before it starts. (c.*, the plain
    path, is computed before the start; autograd accumulates it when its turn comes.)"""
    events: list[tuple[int, str]] = []
    start, finish = overlap.Region.start, overlap.Region.finish

    def started(self: overlap.Region, grad: Tensor) -> Tensor:
        _note(events, group_rank(self.group), "start")
        return start(self, grad)

    def finished(self: overlap.Region, grad: Tensor) -> Tensor:
        _note(events, group_rank(self.group), "finish")
        return finish(self, grad)

    monkeypatch.setattr(overlap.Region, "start", started)
    monkeypatch.setattr(overlap.Region, "finish", finished)
    run_threaded(2, _ordered, events)
    for rank in range(2):
        seq = [what for r, what in events if r == rank]
        s, f = seq.index("start"), seq.index("finish")
        assert {"a.bias", "a.weight", "b.bias", "b.weight"} <= set(seq[s + 1 : f]), seq
        assert {"out.bias", "out.weight"} <= set(seq[:s]), seq


def _split(rank: int, calls: list[int]) -> tuple[list[Tensor], list[Tensor]]:
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    module = _Region(8, 8, True)
    deferred = [module.a.weight, module.a.bias, module.b.weight, module.b.bias]
    y = module(x).sum()
    torch.autograd.grad(y, [x], retain_graph=True)
    assert calls == [], "the input-only backward computed weight gradients"
    later = torch.autograd.grad(y, deferred, retain_graph=True)
    y.backward()
    return list(later), [p.grad for p in deferred]  # type: ignore[misc]


def test_an_input_only_backward_defers_the_weight_gradients(monkeypatch: Any) -> None:
    """``autograd.grad`` for the input alone computes no deferred weight gradient; asking for
    the weights after (the graph retained), then a full backward, both give the same
    gradients (nothing counted twice), exactly: the same products of the same tensors."""
    calls: list[int] = []
    grads = overlap.Slot.grads

    def counting(self: overlap.Slot) -> Any:
        calls.append(1)
        return grads(self)

    monkeypatch.setattr(overlap.Slot, "grads", counting)
    for later, full in run_threaded(2, _split, calls):
        for a, b in zip(later, full, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _steps(rank: int) -> None:
    module = _Region(8, 8, True)
    for _ in range(3):
        module(torch.randn(2, 3, 8).requires_grad_(True)).sum().backward()


def test_a_finished_step_leaves_no_region_behind(monkeypatch: Any) -> None:
    """Once the steps' graphs are gone, none of the ``Region``\\ s they made survives (each
    holds its forward's tensors: one kept past the step would leak the step's graph, a cycle
    through autograd's C++ nodes that ``gc`` cannot collect)."""
    made: list[weakref.ref[overlap.Region]] = []
    init = overlap.Region.__init__

    def tracked(self: overlap.Region, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        with _LOCK:
            made.append(weakref.ref(self))

    monkeypatch.setattr(overlap.Region, "__init__", tracked)
    run_threaded(2, _steps)
    gc.collect()
    assert len(made) == 2 * 3, len(made)
    assert [r for r in made if r() is not None] == []
