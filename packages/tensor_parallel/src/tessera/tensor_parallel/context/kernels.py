"""The attention of one (queries x keys) block of ring attention, forward and backward.

Ring attention needs, for each block, the normalised output with the log-sum-exp of every
query row (to merge the blocks), and backward the block's dq, dk, dv from the *final* output
and log-sum-exp (flash-attention style: ``p = exp(s - lse)``, ``ds = p (dout v^T - delta)``
with ``delta = rowsum(dout * out)``).

Two implementations of that contract:

- fused: torch's flash-attention kernel for the CPU, which returns the log-sum-exp and takes
  the final output and log-sum-exp in its backward, so a block costs what
  ``scaled_dot_product_attention`` costs for its shape. Used on CPU tensors when the block
  has all pairs or exactly the causal triangle (every block of the contiguous and zigzag
  layouts).
- unfused: the same arithmetic in separate operators (any device, any mask). It writes and
  reads the (queries x keys) scores several times. Forward + backward of one fp32 block,
  one thread of this 2-core machine: (batch 16, 8 heads, 32 x 32, head dim 32) 3.4-3.7 ms
  against 1.3-1.4 ms fused; (1, 4, 2048 x 2048, 16) 480-610 ms against 50-78 ms. With the
  fused kernel the planner bench's sp=2 ring step went from 0.304 s to 0.271 s.

`use_fused` says which one a block gets; both return fp32 results for fp32 inputs and agree
to round-off (``test_cp_kernels.py``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["block_backward", "block_forward", "fused_available", "use_fused"]


def fused_available() -> bool:
    """Whether this torch has the CPU flash-attention kernel and its backward."""
    aten = torch.ops.aten
    return hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


_FUSED = fused_available()


def use_fused(q: Tensor, mask: Tensor | None) -> bool:
    """Whether a block of queries ``q`` takes the fused kernel: CPU tensors, no general mask
    (all pairs or the causal triangle), and a torch that has the kernel."""
    return _FUSED and q.device.type == "cpu" and mask is None


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float) -> Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
    return s if mask is None else s.masked_fill(~mask, -math.inf)


def block_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Normalised attention output of one block and its (..., rows, 1) log-sum-exp (``-inf`` on
    rows with no key). The allowed pairs: ``causal``, the lower triangle of a square block;
    else ``mask`` (True: allowed), or all of them when None."""
    if use_fused(q, mask):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse.unsqueeze(-1)
    s = _scores(q, k, mask, causal, scale)
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    return (p @ v) / total.clamp_min(torch.finfo(total.dtype).tiny), top + torch.log(total)


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
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one block from the final output ``out``, its (..., rows, 1) log-sum-exp
    and ``delta = rowsum(dout * out)`` (the fused kernel computes delta from ``out`` itself)."""
    if use_fused(q, mask):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.squeeze(-1), 0.0, causal, scale=scale
        )
        return dq, dk, dv
    p = torch.exp(_scores(q, k, mask, causal, scale) - lse)
    ds = p * (dout @ v.transpose(-1, -2) - delta)
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ dout
