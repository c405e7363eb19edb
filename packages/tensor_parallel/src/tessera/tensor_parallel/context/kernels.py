"""The attention of one (queries x keys) block of ring attention, forward and backward.

Ring attention needs, for each block, the normalised output with the log-sum-exp of every
query row (to merge the blocks), and backward the block's dq, dk, dv from the *final* output
and log-sum-exp (flash-attention style: ``p = exp(s - lse)``, ``ds = p (dout v^T - delta)``
with ``delta = rowsum(dout * out)``).

Implementations of that contract (`kernel` says which one a block gets):

- ``cpu-flash``: torch's flash-attention kernel for the CPU, which returns the log-sum-exp and
  takes the final output and log-sum-exp in its backward, so a block costs what
  ``scaled_dot_product_attention`` costs for its shape.
- ``cuda-flash`` (fp16 / bf16) and ``cuda-efficient`` (fp32): torch's CUDA flash-attention and
  memory-efficient kernels, which return the log-sum-exp the same way; head dims up to 256
  (a multiple of 8 for flash, of 4 for the memory-efficient kernel).
- ``unfused``: the same arithmetic in separate operators (any device, any dtype, any mask). It
  writes and reads the (queries x keys) scores several times. Forward + backward of one fp32
  block, one thread of this 2-core machine: (batch 16, 8 heads, 32 x 32, head dim 32)
  3.4-3.7 ms against 1.3-1.4 ms fused; (1, 4, 2048 x 2048, 16) 480-610 ms against 50-78 ms.
  With the fused kernel the planner bench's cp=2 ring step went from 0.304 s to 0.271 s.

A fused kernel is taken when the block has all pairs or exactly the causal triangle (every
block of the contiguous and zigzag layouts). Every path returns the output in the inputs'
dtype; the fused ones return an fp32 log-sum-exp. The CPU kernel agrees with the unfused path
to round-off (``test_cp_kernels.py``); the CUDA ones are compared with it by
``benchmarks/gpu`` (the ``cp-kernels`` check).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Kernel", "block_backward", "block_forward", "choose", "fused_available", "kernel", "use_fused"]

Kernel = Literal["cpu-flash", "cuda-flash", "cuda-efficient", "unfused"]
_LSE_ALIGN = 32  # the memory-efficient kernel pads its log-sum-exp rows to a multiple of this


def fused_available() -> bool:
    """Whether this torch has the CPU flash-attention kernel and its backward."""
    aten = torch.ops.aten
    return hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


_FUSED = fused_available()


def choose(
    device_type: str, dtype: torch.dtype, head_dim: int, masked: bool, *, cpu_fused: bool = True
) -> Kernel:
    """The kernel for a block of queries on ``device_type`` (``"cpu"``, ``"cuda"``, ...) of
    ``dtype`` and ``head_dim``; ``masked``: the block needs a general mask (then only the
    unfused path serves). ``cpu_fused``: this torch has the CPU kernel."""
    if masked:
        return "unfused"
    if device_type == "cpu":
        return "cpu-flash" if cpu_fused else "unfused"
    if device_type != "cuda" or head_dim > 256:
        return "unfused"
    if dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0:
        return "cuda-flash"
    if dtype == torch.float32 and head_dim % 4 == 0:
        return "cuda-efficient"
    return "unfused"


def kernel(q: Tensor, mask: Tensor | None) -> Kernel:
    """The kernel a block of queries ``q`` takes (`choose` on its device, dtype, head dim)."""
    return choose(q.device.type, q.dtype, q.shape[-1], mask is not None, cpu_fused=_FUSED)


def use_fused(q: Tensor, mask: Tensor | None) -> bool:
    """Whether a block of queries ``q`` takes a fused kernel (any but ``unfused``)."""
    return kernel(q, mask) != "unfused"


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float) -> Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
    return s if mask is None else s.masked_fill(~mask, -math.inf)


def _unused(q: Tensor) -> Tensor:
    """A placeholder for the CUDA kernels' random-number state (read only under dropout)."""
    return torch.empty((), dtype=torch.long, device=q.device)


def block_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    *,
    which: Kernel | None = None,
) -> tuple[Tensor, Tensor]:
    """Normalised attention output of one block and its (..., rows, 1) log-sum-exp (``-inf`` on
    rows with no key). The allowed pairs: ``causal``, the lower triangle of a square block;
    else ``mask`` (True: allowed), or all of them when None. ``which``: the implementation
    (default: `kernel`'s choice; ``"unfused"`` serves every block)."""
    which = kernel(q, mask) if which is None else which
    aten = torch.ops.aten
    if which == "cpu-flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.unsqueeze(-1)
    if which != "unfused":
        return _cuda_forward(which, q, k, v, causal, scale)
    s = _scores(q, k, mask, causal, scale)
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    return (p @ v) / total.clamp_min(torch.finfo(total.dtype).tiny), top + torch.log(total)


def _cuda_forward(
    which: Kernel, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    aten = torch.ops.aten
    if which == "cuda-flash":
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse.unsqueeze(-1)
    out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[-2]].unsqueeze(-1)


def _cuda_backward(
    which: Kernel,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, dout = out.to(q.dtype).contiguous(), dout.to(q.dtype).contiguous()
    rows, cols = q.shape[-2], k.shape[-2]
    lse = lse.squeeze(-1).float()
    aten = torch.ops.aten
    if which == "cuda-flash":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, rows, cols, 0.0, causal,
            _unused(q), _unused(q), scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    padded = F.pad(lse, (0, -rows % _LSE_ALIGN)).contiguous()
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, padded, _unused(q), _unused(q), 0.0, [True, True, True, False], causal,
        scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    delta: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    *,
    which: Kernel | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one block from the final output ``out``, its (..., rows, 1) log-sum-exp
    and ``delta = rowsum(dout * out)`` (the fused kernels compute delta from ``out`` itself).
    ``which``: as for `block_forward`."""
    which = kernel(q, mask) if which is None else which
    if which == "cpu-flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.squeeze(-1).float(), 0.0, causal, scale=scale
        )  # the final output may be in another dtype than the block (fp32 in the ring)
        return dq, dk, dv
    if which != "unfused":
        return _cuda_backward(which, q, k, v, out, lse, dout, causal, scale)
    p = torch.exp(_scores(q, k, mask, causal, scale) - lse)
    ds = p * (dout @ v.transpose(-1, -2) - delta)
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ dout
