"""Tier 1: each differentiable op's output and gradient against a serial autograd reference.

The reference runs the whole n-rank computation in one process: the op as plain tensor
code over the list of every rank's input, a loss that sums <y_r, w_r> over ranks (or, for
a replicated consumer, <y, w> counted once), and torch.autograd for the gradients.
For ops that take a replicated input (f, split) the ranks share one serial leaf.

Tolerances: fp32 1e-5 (the ranks' sums run in another order than the serial ``sum``, over
at most 8 values of order 1); bf16 rtol 2e-2, atol 2e-2 * n (the ranks compute in bf16 and
round each of the n summands once, 2**-8 relative, where the reference sums in fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm import (
    all_gather_along,
    all_to_all_along,
    broadcast_from,
    copy_to_region,
    gather_along,
    group_size,
    reduce_from_region,
    reduce_scatter_along,
    split_along,
)
from tessera.comm.testing import run_threaded


@dataclass(frozen=True)
class Op:
    parallel: Callable[[Tensor, int], Tensor]  # (x, dim) -> y on one rank
    serial: Callable[[list[Tensor], int, int], list[Tensor]]  # (xs, dim, n) -> ys
    replicated_input: bool = False  # every rank holds the same x
    replicated_output: bool = False  # every rank's y is the same; the loss counts it once
    divisible: bool = False  # dim must divide by n


OPS: dict[str, Op] = {
    "copy_to_region": Op(
        lambda x, d: copy_to_region(x), lambda xs, d, n: list(xs), replicated_input=True
    ),
    "reduce_from_region": Op(
        lambda x, d: reduce_from_region(x),
        lambda xs, d, n: [sum(xs[1:], xs[0])] * n,
        replicated_output=True,
    ),
    # the in-place forms: the input is a temporary (x * 1), the gradient a new product (y * w)
    "copy_to_region_grad_inplace": Op(
        lambda x, d: copy_to_region(x, grad_inplace=True), lambda xs, d, n: list(xs), replicated_input=True
    ),
    "reduce_from_region_inplace": Op(
        lambda x, d: reduce_from_region(x * 1, inplace=True),
        lambda xs, d, n: [sum(xs[1:], xs[0])] * n,
        replicated_output=True,
    ),
    "split_along": Op(
        lambda x, d: split_along(x, d),
        lambda xs, d, n: [xs[r].chunk(n, d)[r] for r in range(n)],
        replicated_input=True,
        divisible=True,
    ),
    "gather_along": Op(
        lambda x, d: gather_along(x, d),
        lambda xs, d, n: [torch.cat(xs, d)] * n,
        replicated_output=True,
    ),
    "all_gather_along": Op(
        lambda x, d: all_gather_along(x, d), lambda xs, d, n: [torch.cat(xs, d)] * n
    ),
    "reduce_scatter_along": Op(
        lambda x, d: reduce_scatter_along(x, d),
        lambda xs, d, n: list(sum(xs[1:], xs[0]).chunk(n, d)),
        divisible=True,
    ),
    "all_to_all_along": Op(
        lambda x, d: all_to_all_along(x, d, (d + 1) % x.dim()),
        lambda xs, d, n: [
            torch.cat([xs[s].chunk(n, d)[r] for s in range(n)], (d + 1) % xs[0].dim())
            for r in range(n)
        ],
        divisible=True,
    ),
    "broadcast_from": Op(
        lambda x, d: broadcast_from(x, src=1 % group_size(None)),
        lambda xs, d, n: [xs[1 % n]] * n,
    ),
}


def _rank(rank: int, name: str, xs: list[Tensor], ws: list[Tensor], dim: int) -> tuple[Tensor, Tensor]:
    x = xs[rank].clone().requires_grad_(True)
    y = OPS[name].parallel(x, dim)
    (y * ws[rank]).sum().backward()
    assert x.grad is not None
    return y.detach(), x.grad


@pytest.mark.parametrize("name", sorted(OPS))
@settings(max_examples=25)
@given(
    n=st.sampled_from([1, 2, 3, 4, 8]),
    shape=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    dim=st.integers(0, 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_op_matches_serial_autograd(
    name: str, n: int, shape: list[int], dim: int, dtype: torch.dtype, seed: int
) -> None:
    op = OPS[name]
    if op.divisible:
        shape[dim] *= n
    gen = torch.Generator().manual_seed(seed)
    # serial leaves, in fp32 from the same (dtype-rounded) values the ranks get
    base = [torch.randn(shape, generator=gen).to(dtype).float() for _ in range(n)]
    if op.replicated_input:
        leaves = [base[0].clone().requires_grad_(True)] * n
    else:
        leaves = [b.clone().requires_grad_(True) for b in base]
    unique = list({id(leaf): leaf for leaf in leaves}.values())
    ys = op.serial(leaves, dim, n)
    ws = [torch.randn(ys[r].shape, generator=gen).to(dtype).float() for r in range(n)]
    if op.replicated_output:
        ws = [ws[0]] * n
        loss = (ys[0] * ws[0]).sum()
    else:
        loss = sum(((y * w).sum() for y, w in zip(ys, ws, strict=True)), torch.zeros(()))
    grads = torch.autograd.grad(loss, unique, allow_unused=True)
    grad_of = {
        id(leaf): torch.zeros_like(leaf) if g is None else g
        for leaf, g in zip(unique, grads, strict=True)
    }

    out = run_threaded(
        n, _rank, name, [leaf.detach().to(dtype) for leaf in leaves], [w.to(dtype) for w in ws], dim
    )
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2 * n, 2e-2)
    for r, (y, g) in enumerate(out):
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), ys[r].detach(), atol=atol, rtol=rtol)
        torch.testing.assert_close(g.float(), grad_of[id(leaves[r])], atol=atol, rtol=rtol)


def _inplace_rank(rank: int) -> tuple[Tensor, Tensor, bool, Tensor]:
    leaf = torch.full((2, 3), float(rank + 1), requires_grad=True)
    tmp = leaf * 2  # a temporary: reduced in place, the same tensor comes back
    y = reduce_from_region(tmp, inplace=True)
    same = y is tmp
    saved = leaf.exp()  # exp saves its output: reducing it in place must not go unnoticed
    z = reduce_from_region(saved, inplace=True)
    try:
        z.sum().backward()
        raised = torch.zeros(())
    except RuntimeError:
        raised = torch.ones(())
    return y.detach(), leaf.detach(), same, raised


def test_inplace_reduce_writes_the_temporary_and_autograd_guards_saved_tensors() -> None:
    """reduce_from_region(inplace=True) returns its input holding the sum (exact: small
    integers); a leaf is never written; reducing a tensor a backward saved makes that
    backward raise instead of reading the sum."""
    out = run_threaded(2, _inplace_rank)
    for rank, (y, leaf, same, raised) in enumerate(out):
        assert same
        assert torch.equal(y, torch.full((2, 3), 6.0))
        assert torch.equal(leaf, torch.full((2, 3), float(rank + 1)))
        assert raised.item() == 1.0
