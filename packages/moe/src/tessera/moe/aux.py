"""The router's auxiliary losses trained from inside the layer, in any composition.

A layer built with ``aux_loss_coef=a`` or ``z_loss_coef=b`` returns its output through
`attach_aux`: the forward is the identity, and the backward passes the output's gradient
through unchanged and also starts ``d(s * (a * aux + b * z)) / d(router)`` from that call's
losses, where ``s`` is the layer's ``aux_grad_scale`` read at backward time. No caller adds
the losses to its loss, so a pipeline stage that does not hold the loss still trains its
routers (Megatron attaches its MoE losses the same way).

**The scale.** A caller that backpropagates ``c * loss`` (gradient accumulation over ``m``
microbatches: ``c = 1 / m``; fp16 loss scaling by ``S``: ``c = S / m``) must set ``s = c``
(`tessera.moe.set_aux_grad_scale`) before the backward, so that the gradients are those of
``c * (loss + a * aux + b * z)``: the losses weigh what they would if the caller had added
them to each microbatch's loss by hand. The coefficient applies per forward call, to that
call's tokens: with ``m`` microbatches the router learns from the mean over microbatches of
each microbatch's ``a * aux + b * z``, exactly as a serial loop that adds them to each
microbatch's loss and divides by ``m``. (The load-balancing loss is not linear in the
tokens, so a whole batch's ``aux`` differs from its microbatches' mean; under data or expert
parallelism each rank's call sees its own tokens, and the data-parallel average of the
router's gradient makes it the mean over ranks as well.)
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

__all__ = ["AuxScale", "attach_aux", "scale_grad"]


class AuxScale(Protocol):
    """What `attach_aux` reads the backward scale from (an `MoE` layer)."""

    aux_grad_scale: float


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, out: Tensor, aux: Tensor, holder: AuxScale) -> Tensor:
        ctx.holder = holder  # type: ignore[attr-defined]  # FunctionCtx takes attributes
        ctx.aux_shape = aux.shape  # type: ignore[attr-defined]
        ctx.aux_dtype = aux.dtype  # type: ignore[attr-defined]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        scale = float(ctx.holder.aux_grad_scale)
        return grad, torch.full(ctx.aux_shape, scale, dtype=ctx.aux_dtype, device=grad.device), None


def attach_aux(out: Tensor, aux: Tensor, holder: AuxScale) -> Tensor:
    """``out`` unchanged, whose backward also backpropagates ``holder.aux_grad_scale * aux``
    (a scalar). Moves nothing."""
    return cast(Tensor, _Attach.apply(out, aux, holder))  # type: ignore[no-untyped-call]  # torch: Function.apply is unannotated


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor  # type: ignore[attr-defined]  # FunctionCtx takes attributes
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def scale_grad(x: Tensor, factor: float) -> Tensor:
    """``x`` unchanged, whose backward multiplies the gradient by ``factor``: a loss that every
    rank of a tensor-parallel group computes whole, from the same tokens, weighs ``1 / tp`` on
    each, so that the gradients the group sums over its ranks count it once."""
    return cast(Tensor, _ScaleGrad.apply(x, factor))  # type: ignore[no-untyped-call]  # torch: Function.apply is unannotated
