"""Ring attention: K/V blocks travel around the ``cp`` ring while each rank attends to them.

Each rank holds q, k, v for its slice of the sequence (a ``Layout``). Forward: ``cp`` steps;
at step i a rank attends its queries to the K/V block of rank ``r - i`` and merges the
partial result by the log-sum-exp rule, while the next block is already in flight
(``ring_shift_async``). Under causal attention only the query rows and key columns of a
block with allowed pairs are computed, so the zigzag layout gives every rank the same work
(half a block per step besides its own) and contiguous skips the blocks of later ranks.
Backward recomputes each block's probabilities from the saved log-sum-exp (flash-attention
style); K/V travel the ring again and the dK/dV accumulated for a block travel with it,
arriving home after ``cp - 1`` hops. Each block's arithmetic is `kernels`: torch's fused
flash-attention kernel on CPU tensors (every block of both layouts is unmasked or exactly
causal), separate operators elsewhere.

Bytes sent per rank: forward ``(cp - 1)`` local K and V blocks, i.e. ``(cp-1)/cp`` of the
full K and V; backward twice that (K/V again, and their gradients). Grouped-query attention
sends the smaller K/V and expands heads only for computing. Arithmetic runs in fp32; K/V
travel in their own dtype, dK/dV accumulate (and travel) in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tessera.comm import Group, Handle, group_rank, group_size, ring_shift_async, share_memory
from tessera.comm.ops import apply_function
from tessera.tensor_parallel.context.kernels import block_backward, block_forward
from tessera.tensor_parallel.context.layout import Layout, local_positions

__all__ = ["check_heads", "check_window", "ring_attention"]


def check_heads(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Heads per K/V head of (batch, heads, seq, head_dim) q, k, v; ValueError naming the sizes."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"attention wants (batch, heads, seq, head_dim) q, k, v with k and v alike; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv heads={kv_heads}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, sequence or head_dim")
    return heads // kv_heads


@dataclass(frozen=True, slots=True)
class _Block:
    """The part of one (queries x keys) block with work: the kept rows and columns (None: all)
    and which of their pairs are allowed: all, the causal lower triangle, or a general mask."""

    rows: Tensor | None
    cols: Tensor | None
    q_pos: Tensor | None = None  # positions of the kept rows and columns when not all pairs
    k_pos: Tensor | None = None  # are allowed (None: all are)
    causal: bool = False  # the allowed pairs are exactly the lower triangle of a square block
    window: int | None = None  # a query sees keys less than this many positions back

    @staticmethod
    def between(q_pos: Tensor | None, k_pos: Tensor | None, window: int | None = None) -> _Block | None:
        """Causal (key position <= query position, and within ``window`` of it when given)
        work between two sets of positions; None: none. From the 1-D positions alone: a row
        has work when some key is at or before it (and within the window), a column when some
        query is at or after it (and within the window)."""
        if q_pos is None or k_pos is None:
            return _Block(None, None)
        if window is not None:
            return _Block._windowed(q_pos, k_pos, window)
        rows = q_pos >= k_pos.min()
        if not bool(rows.any()):
            return None
        cols = k_pos <= q_pos.max()
        q_kept, k_kept = q_pos[rows], k_pos[cols]
        full = bool(q_kept.min() >= k_kept.max())
        causal = (
            not full
            and q_kept.shape == k_kept.shape
            and bool(torch.equal(q_kept, k_kept))
            and bool((q_kept[1:] > q_kept[:-1]).all())
        )
        return _Block(
            None if bool(rows.all()) else rows.nonzero().squeeze(1),
            None if bool(cols.all()) else cols.nonzero().squeeze(1),
            None if full else q_kept,
            None if full else k_kept,
            causal,
        )

    @staticmethod
    def _windowed(q_pos: Tensor, k_pos: Tensor, window: int) -> _Block | None:
        """`between` under a sliding window: a block wholly outside it has no work (skipped:
        no arithmetic, only the K/V passing through), one wholly inside is unmasked."""
        back = q_pos[:, None] - k_pos[None, :]
        allowed = (back >= 0) & (back < window)
        rows, cols = allowed.any(1), allowed.any(0)
        if not bool(rows.any()):
            return None
        q_kept, k_kept = q_pos[rows], k_pos[cols]
        full = bool(allowed[rows][:, cols].all())
        return _Block(
            None if bool(rows.all()) else rows.nonzero().squeeze(1),
            None if bool(cols.all()) else cols.nonzero().squeeze(1),
            None if full else q_kept,
            None if full else k_kept,
            window=window,
        )

    def mask(self) -> Tensor | None:
        """The allowed pairs among those kept when they are neither all nor the causal
        triangle (``causal``); None otherwise."""
        if self.q_pos is None or self.k_pos is None or self.causal:
            return None
        back = self.q_pos[:, None] - self.k_pos[None, :]
        allowed = back >= 0
        return allowed if self.window is None else allowed & (back < self.window)

    @staticmethod
    def _take(x: Tensor, index: Tensor | None) -> Tensor:
        return x if index is None else x.index_select(2, index)

    @staticmethod
    def _put(x: Tensor, index: Tensor | None, length: int, fill: float) -> Tensor:
        if index is None:
            return x
        shape = (*x.shape[:2], length, *x.shape[3:])
        return x.new_full(shape, fill).index_copy_(2, index, x)

    def rows_of(self, *xs: Tensor) -> list[Tensor]:
        """The kept query rows of each (batch, heads, seq, ...) tensor."""
        return [self._take(x, self.rows) for x in xs]

    def cols_of(self, *xs: Tensor) -> list[Tensor]:
        """The kept key columns of each (batch, heads, seq, ...) tensor."""
        return [self._take(x, self.cols) for x in xs]

    def rows_to(self, x: Tensor, length: int, fill: float) -> Tensor:
        """``x`` of the kept rows put back among ``length`` rows, the others ``fill``."""
        return self._put(x, self.rows, length, fill)

    def cols_to(self, x: Tensor, length: int) -> Tensor:
        """``x`` of the kept columns put back among ``length`` columns, the others zero."""
        return self._put(x, self.cols, length, 0.0)


class _Ring:
    """What every step of one call needs: the group, sizes, positions and GQA expansion."""

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        group: Group,
        causal: bool,
        layout: Layout,
        scale: float,
        window: int | None,
    ) -> None:
        self.group, self.scale, self.window = group, scale, window
        self.cp, self.rank = group_size(group), group_rank(group)
        if self.cp > 1:
            share_memory(group)  # collective once: the ring's messages then go through shared memory
        self.groups = q.shape[1] // k.shape[1]
        n = q.shape[2]
        self.positions = [
            local_positions(r, self.cp, n, layout, q.device) if causal else None for r in range(self.cp)
        ]
        self._blocks: dict[int, _Block | None] = {}

    def source(self, step: int) -> int:
        """The rank whose K/V block this rank holds at ``step``."""
        return (self.rank - step) % self.cp

    def block(self, step: int) -> _Block | None:
        """The work between this rank's queries and the K/V block of ``step``; None: nothing
        (worked out once per call: backward reuses forward's)."""
        if step not in self._blocks:
            mine, theirs = self.positions[self.rank], self.positions[self.source(step)]
            self._blocks[step] = _Block.between(mine, theirs, self.window)
        return self._blocks[step]

    def expand(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """K and V (fp32) of a stacked (2, batch, kv_heads, seq, dim) block, heads repeated for q."""
        k, v = kv.float().unbind(0)
        if self.groups == 1:
            return k, v
        return k.repeat_interleave(self.groups, 1), v.repeat_interleave(self.groups, 1)

    def fold(self, dk: Tensor, dv: Tensor) -> Tensor:
        """Stacked dK/dV of a block, with the expanded heads summed back onto the K/V heads."""
        grads = torch.stack([dk, dv])
        if self.groups == 1:
            return grads
        two, b, h, n, d = grads.shape
        return grads.view(two, b, h // self.groups, self.groups, n, d).sum(3)


def _shift(x: Tensor, ring: _Ring, step: int) -> Handle[Tensor] | None:
    """Send ``x`` on to the next rank unless this is the last step."""
    return ring_shift_async(x, ring.group) if step < ring.cp - 1 else None


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        group: Group,
        causal: bool,
        layout: Layout,
        scale: float,
        window: int | None,
    ) -> Tensor:
        q32 = q.detach().float()
        ring = _Ring(q32, k, group, causal, layout, scale, window)
        kv = torch.stack([k.detach(), v.detach()])  # travels in the input dtype
        out = lse = None
        for step in range(ring.cp):
            handle = _shift(kv, ring, step)  # the next block travels while this one is computed
            block = ring.block(step)
            if block is not None:  # only the rows and columns with work (zigzag: half the block)
                (q_b,), (k_b, v_b) = block.rows_of(q32), block.cols_of(*ring.expand(kv))
                o, s = block_forward(q_b, k_b, v_b, block.mask(), block.causal, scale)
                o, s = block.rows_to(o, q32.shape[2], 0.0), block.rows_to(s, q32.shape[2], -math.inf)
                if out is None or lse is None:
                    out, lse = o, s
                else:
                    new = torch.logaddexp(lse, s)
                    out = out * torch.exp(lse - new) + o * torch.exp(s - new)
                    lse = new
            if handle is not None:
                kv = handle.wait()
        assert out is not None and lse is not None  # step 0 is this rank's own block: never skipped
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, None, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        q32, dout32 = q.float(), dout.float()
        delta = (dout32 * out).sum(-1, keepdim=True)
        kv = torch.stack([k, v])
        dq, n = torch.zeros_like(q32), q32.shape[2]
        own = torch.zeros_like(kv, dtype=torch.float32)
        travelling: Handle[Tensor] | None = None  # dK/dV of the block that arrives next
        for step in range(ring.cp):
            handle = _shift(kv, ring, step)
            block = ring.block(step)
            grads = torch.zeros_like(own)
            if block is not None:
                q_b, out_b, lse_b, dout_b, delta_b = block.rows_of(q32, out, lse, dout32, delta)
                k_b, v_b = block.cols_of(*ring.expand(kv))
                dq_b, dk_b, dv_b = block_backward(
                    q_b, k_b, v_b, out_b, lse_b, dout_b, delta_b, block.mask(), block.causal, ring.scale
                )
                dq += block.rows_to(dq_b, n, 0.0)
                grads = ring.fold(block.cols_to(dk_b, n), block.cols_to(dv_b, n))
            if step == 0:
                own = grads
            else:  # add this block's share to what earlier ranks gathered, pass it on towards home
                gathered = grads if travelling is None else travelling.wait() + grads
                travelling = ring_shift_async(gathered, ring.group)
            if handle is not None:
                kv = handle.wait()
        if travelling is not None:
            own = own + travelling.wait()
        dk, dv = own.unbind(0)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Group,
    causal: bool = True,
    layout: Layout | str = Layout.CONTIGUOUS,
    scale: float | None = None,
    window: int | None = None,
) -> Tensor:
    """Attention of this rank's queries to the whole sequence, K/V passed around the ring.

    ``q`` is (batch, heads, local_seq, head_dim), ``k`` and ``v`` (batch, kv_heads, local_seq,
    head_dim) with ``heads`` a multiple of ``kv_heads``; every rank holds its slice of the
    sequence by ``layout``. Returns this rank's slice of the output, shaped like ``q``: equal
    to ``scaled_dot_product_attention`` of the full sequence, sliced. ``window`` (causal only):
    each query attends to the keys less than ``window`` positions before it (sliding-window
    attention, Mistral's and Gemma's); a block with no pair inside the window is skipped, so
    the arithmetic shrinks with the window (the K/V blocks still travel the whole ring). Sends
    ``cp - 1`` K/V blocks per rank forward, twice that backward (see the module docstring).
    """
    check_heads(q, k, v)
    check_window(window, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return apply_function(_RingAttention, q, k, v, group, causal, Layout(layout), scale, window)


def check_window(window: int | None, causal: bool) -> None:
    """ValueError unless ``window`` is None or a positive window of causal attention."""
    if window is not None and (window < 1 or not causal):
        raise ValueError(
            f"a sliding window must be positive and causal; got window={window}, causal={causal}"
        )
