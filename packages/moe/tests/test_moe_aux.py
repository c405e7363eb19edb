"""Tiers 0 and 1: the auxiliary losses attached inside the layer (``aux_loss_coef``,
``z_loss_coef``) give the gradients of adding them to the loss by hand: serially, under
microbatches with a loss scale (``set_aux_grad_scale``), in a pipeline-like split where the
stage holding the router never sees the loss, and at ep=2 with `reduce_gradients`.

Tolerance: fp32 rtol 1e-5, atol 1e-6 (1e-5 at ep=2, as in ``test_moe_grads.py``). Both sides
compute the same products; the router's gradient is summed from the same terms in another
order (the attached scalar's backward joins the output's at the router), a few ulps. A
missing or unscaled attachment changes the router's gradient by the coefficients' share,
orders of magnitude more.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tessera.comm.testing import run_threaded
from tessera.moe import MoE, reduce_gradients, set_aux_grad_scale

TOL = {"rtol": 1e-5, "atol": 1e-6}
A, Z = 0.3, 0.05
CONFIG: dict[str, Any] = {
    "d_model": 6,
    "hidden": 8,
    "experts": 4,
    "top_k": 2,
    "capacity_factor": 1.0,
    "seed": 3,
}


def _pair() -> tuple[MoE, MoE]:
    """The same layer twice: one attaching its losses, one whose caller adds them."""
    attached = MoE(**CONFIG, aux_loss_coef=A, z_loss_coef=Z)
    by_hand = copy.deepcopy(attached)
    by_hand.aux_loss_coef = by_hand.z_loss_coef = 0.0
    return attached, by_hand


def _grads(module: nn.Module) -> dict[str, Tensor]:
    out = {}
    for n, p in module.named_parameters():
        assert p.grad is not None, n
        out[n] = p.grad
    return out


def _assert_same(got: dict[str, Tensor], want: dict[str, Tensor], **tol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **(tol or TOL))


def _data(tokens: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (tokens, CONFIG["d_model"])
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def test_attached_losses_equal_adding_them_by_hand() -> None:
    attached, by_hand = _pair()
    plain = copy.deepcopy(by_hand)
    x, g = _data(10)
    (attached(x) * g).sum().backward()
    (by_hand(x) * g).sum().add(A * by_hand.aux_loss + Z * by_hand.z_loss).backward()
    _assert_same(_grads(attached), _grads(by_hand))
    # the attachment is not a no-op: without it the router's gradient differs
    (plain(x) * g).sum().backward()
    assert plain.router.weight.grad is not None and attached.router.weight.grad is not None
    assert not torch.allclose(plain.router.weight.grad, attached.router.weight.grad, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(("microbatches", "loss_scale"), [(1, 1.0), (3, 1.0), (3, 1024.0), (2, 8.0)])
def test_microbatches_with_a_loss_scale_equal_the_serial_mean(microbatches: int, loss_scale: float) -> None:
    """The engine's way: backward of ``S * loss_i / m`` per microbatch, the gradient then
    divided by ``S``; the attached losses with ``aux_grad_scale = S / m`` give the gradient of
    the mean over microbatches of ``loss_i + A * aux_i + Z * z_i``."""
    attached, by_hand = _pair()
    model = nn.Sequential(nn.Linear(6, 6), attached)
    reference = nn.Sequential(copy.deepcopy(model[0]), by_hand)
    x, g = _data(12, seed=1)
    assert set_aux_grad_scale(model, loss_scale / microbatches) == 1
    for xb, gb in zip(x.chunk(microbatches), g.chunk(microbatches), strict=True):
        (loss_scale * (model(xb) * gb).sum() / microbatches).backward()
    for p in model.parameters():
        assert p.grad is not None
        p.grad.div_(loss_scale)
    for xb, gb in zip(x.chunk(microbatches), g.chunk(microbatches), strict=True):
        ((reference(xb) * gb).sum() + A * by_hand.aux_loss + Z * by_hand.z_loss).div(microbatches).backward()
    _assert_same(_grads(model), _grads(reference))


def test_a_stage_without_the_loss_still_trains_its_router() -> None:
    """Like a pipeline's first stage: the layer's output leaves the stage, and only the
    gradient of it comes back; the router still gets the attached losses' share."""
    attached, by_hand = _pair()
    x, g = _data(9, seed=2)
    out = attached(x)
    sent = out.detach().requires_grad_()  # the next stage's input
    (sent * g).sum().backward()
    assert sent.grad is not None
    out.backward(sent.grad)  # the gradient received back
    (by_hand(x) * g).sum().add(A * by_hand.aux_loss + Z * by_hand.z_loss).backward()
    _assert_same(_grads(attached), _grads(by_hand))


def test_no_attachment_without_gradients_and_refusals() -> None:
    attached, _ = _pair()
    with torch.no_grad():
        y = attached(_data(4)[0])
    assert y.grad_fn is None
    with pytest.raises(ValueError, match=r"aux_loss_coef must be >= 0, got -0\.1"):
        MoE(**CONFIG, aux_loss_coef=-0.1)
    with pytest.raises(ValueError, match="z_loss_coef must be >= 0, got -1"):
        MoE(**CONFIG, z_loss_coef=-1)
    with pytest.raises(ValueError, match="scale must be > 0, got 0"):
        set_aux_grad_scale(attached, 0)


def _ep_rank(rank: int, xs: list[Tensor], gs: list[Tensor]) -> dict[str, Tensor]:
    # every rank makes every group, in the same order: group creation is collective
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]
    layer = MoE(**CONFIG, aux_loss_coef=A, z_loss_coef=Z, ep_group=dist.group.WORLD)
    (layer(xs[rank]) * gs[rank]).sum().backward()
    reduce_gradients(layer, data_group=None, expert_data_group=alone[rank])
    return _grads(layer)


def test_expert_parallel_attached_losses_equal_the_serial_mean_over_ranks() -> None:
    xs, gs = zip(*(_data(5 + r, seed=10 + r) for r in range(2)), strict=True)
    _, by_hand = _pair()
    for x, g in zip(xs, gs, strict=True):
        ((by_hand(x) * g).sum() + A * by_hand.aux_loss + Z * by_hand.z_loss).div(2).backward()
    want = _grads(by_hand)
    for rank, got in enumerate(run_threaded(2, _ep_rank, list(xs), list(gs), timeout=60)):
        local = {n: (w[2 * rank : 2 * rank + 2] if n.startswith("experts.") else w) for n, w in want.items()}
        _assert_same(got, local, rtol=1e-5, atol=1e-5)
