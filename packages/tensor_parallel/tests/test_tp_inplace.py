"""The 1D layers reduce their own temporaries in place: no all-reduce of a copy on the hot path.

Counts, not timings: every all-reduce a layer issues is recorded with its ``inplace`` flag
(``tessera.comm.collectives.all_reduce``, and the overlapped region entry's
``all_reduce_async``, wrapped for the test). The values themselves are checked against the
serial twins by test_tp_layers and test_tp_gpt; here the forward and backward results of one
tp=2 step are also compared with a run that forces every all-reduce onto a copy and enters
the region without the overlap (``overlap``) -- exact for the all-reduces (the same sums of
the same tensors, so ``rtol=atol=0``); the overlap computes each weight gradient as
``grad_out^T @ input`` where autograd computes ``(input^T @ grad_out)^T``: the same products
summed over the same tokens, equal to round-off of one fp32 dot product of 6 terms
(``rtol=1e-6``, ``atol=1e-6``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tessera.comm import collectives, copy_to_region, reduce_from_region
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    overlap,
    sequence,
    set_overlap,
)

_LOCK = threading.Lock()


@pytest.fixture
def flags(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """The ``inplace`` flag of every all-reduce issued (any rank), in call order."""
    seen: list[bool] = []
    original: Callable[..., Tensor] = collectives.all_reduce

    def recording(x: Tensor, group: Any = None, op: Any = "sum", *, inplace: bool = False) -> Tensor:
        with _LOCK:
            seen.append(inplace)
        return original(x, group, op, inplace=inplace)

    original_async: Callable[..., Any] = overlap.all_reduce_async

    def recording_async(x: Tensor, group: Any = None, op: Any = "sum", *, inplace: bool = False) -> Any:
        with _LOCK:
            seen.append(inplace)
        return original_async(x, group, op, inplace=inplace)

    monkeypatch.setattr(collectives, "all_reduce", recording)
    monkeypatch.setattr(overlap, "all_reduce_async", recording_async)
    yield seen


def _inputs() -> tuple[Tensor, Tensor]:
    """x and the output weights, drawn here (ranks are threads: the global RNG is shared)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, 8, generator=gen)


def _step(
    rank: int, kind: str, x: Tensor, w: Tensor, overlapped: bool = True
) -> tuple[Tensor, Tensor, list[Tensor]]:
    layer: nn.Module
    if kind == "mlp":
        layer = ParallelMLP(8, 16, group=None, seed=1)
    elif kind == "attention":
        layer = ParallelSelfAttention(8, 2, group=None, seed=1)
    else:
        layer = nn.Sequential(
            ColumnParallelLinear(8, 16, group=None, seed=1),
            RowParallelLinear(16, 8, group=None, input_is_parallel=True),
        )
    assert set_overlap(layer, overlapped) == (3 if kind == "attention" else 1)
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y * w).sum().backward()
    assert x.grad is not None
    return y.detach(), x.grad, [p.grad.clone() for p in layer.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", ["mlp", "attention", "column-row"])
def test_layers_reduce_in_place(kind: str, flags: list[bool]) -> None:
    """Each rank's step issues one forward all-reduce (the row layer's partial sums) and one
    backward all-reduce (the input gradient), all in place."""
    run_threaded(2, _step, kind, *_inputs())
    assert flags == [True] * 4


@pytest.mark.parametrize("kind", ["mlp", "attention", "column-row"])
def test_in_place_equals_reducing_copies(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The outputs and every gradient equal a run whose region ops reduce copies, without
    the overlapped entry."""
    fast = run_threaded(2, _step, kind, *_inputs())
    monkeypatch.setattr(
        sequence, "copy_to_region", lambda x, group, grad_inplace=False: copy_to_region(x, group)
    )
    monkeypatch.setattr(
        sequence, "reduce_from_region", lambda x, group, inplace=False: reduce_from_region(x, group)
    )
    slow = run_threaded(2, _step, kind, *_inputs(), False)
    for (y, gx, gp), (y2, gx2, gp2) in zip(fast, slow, strict=True):
        torch.testing.assert_close(y, y2, rtol=0, atol=0)
        torch.testing.assert_close(gx, gx2, rtol=0, atol=0)
        assert len(gp) == len(gp2)
        for a, b in zip(gp, gp2, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
