"""Seconds that tensor and context parallelism spend communicating per layer and microbatch.

Bytes per rank are the paper accounting of the tensor-parallel README (asserted there
against ``CommMeter``): 1D moves four all-reduces of a layer's output per layer (two forward,
two backward; Megatron sequence parallelism swaps each for an all-gather and a reduce-scatter
of the same total), the backward two at the region entries, which the runtime overlaps with
the entry layers' weight gradients (``hidden_backward``); 2D (SUMMA) moves
``(|X| + |W|)/q`` per Linear forward and twice that backward; 2.5D ``(|X|/d + |W|)/q``
forward, twice backward, plus the depth all-reduce of ``2 |W| / q^2``; 3D
``(|X| + |W| + |Y|)/q^2`` each way; LayerNorms of the grid modes all-reduce their statistics
(16 bytes per token). Context parallelism: ring attention passes ``cp - 1`` K/V blocks
forward (twice that backward, K/V and their gradients), overlapped with the attention it
computes; Ulysses moves four all-to-alls each way. Each collective also pays its latencies
(`Link`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.planner.links import Link
from tessera.planner.model import ModelShape, TPShape

__all__ = ["Traffic", "context_traffic", "edge_traffic", "tensor_traffic"]


@dataclass(frozen=True, slots=True)
class Traffic:
    """Seconds of communication forward and backward; the ``hidden_*`` part may overlap compute."""

    forward: float = 0.0
    backward: float = 0.0
    hidden_forward: float = 0.0
    hidden_backward: float = 0.0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.forward + other.forward,
            self.backward + other.backward,
            self.hidden_forward + other.hidden_forward,
            self.hidden_backward + other.hidden_backward,
        )

    def scaled(self, k: float) -> Traffic:
        """This traffic ``k`` times."""
        return Traffic(self.forward * k, self.backward * k, self.hidden_forward * k, self.hidden_backward * k)


def _linears(model: ModelShape) -> list[tuple[int, int]]:
    d, f = model.hidden, model.ffn
    return [(d, d)] * 4 + [(d, f), (f, d)]


def _grid_linear(
    mode: str, q: int, depth: int, tokens: float, n_in: int, n_out: int, c: int, bias: bool, link: Link
) -> Traffic:
    """One Linear of a grid mode (bytes of the README's table; latencies per collective)."""
    x, w, y = tokens * n_in * c, n_in * n_out * c, tokens * n_out * c
    b = n_out * c if bias else 0
    bw = link.bandwidth
    hops = math.ceil(math.log2(max(q, 2)))
    if mode == "2d":
        fwd = (x + w + b) / q / bw + 2 * q * link.call(hops) + link.call(1)
        bwd = (2 * (x + w) + b) / q / bw + 4 * q * link.call(hops) + link.call(1)
    elif mode == "2.5d":
        fwd = (x / depth + w + b) / q / bw + 2 * q * link.call(hops) + link.call(1)
        depth_ar = 2 * (w + b) / (q * q) / bw + (
            link.call(2 * math.ceil(math.log2(max(depth, 2)))) if depth > 1 else 0
        )
        bwd = (2 * (x / depth + w) + b) / q / bw + 4 * q * link.call(hops) + link.call(1) + depth_ar
    else:  # 3d
        fwd = ((x + w + y) / (q * q) + b * (1 / q + 1 / (q * q))) / bw + 5 * (q - 1) * link.call(1)
        bwd = fwd
    return Traffic(fwd, bwd)


def tensor_traffic(
    model: ModelShape, rows: float, c: int, shape: TPShape, link: Link, *, cp: int = 1
) -> Traffic:
    """Tensor-parallel communication of one transformer layer for a microbatch of ``rows``
    sequences (the tensor-parallel group's rows; ``cp`` splits the sequence)."""
    t = shape.tp
    if t <= 1:
        return Traffic()
    tokens = rows * model.seq / cp
    if shape.mode == "1d":  # backward: the two region entries, overlapped (estimate hides them)
        y = tokens * model.hidden * c
        return Traffic(2 * link.all_reduce(y, t), 0.0, 0.0, 2 * link.all_reduce(y, t))
    grid = shape.grid
    q = grid.side
    total = Traffic()
    for n_in, n_out in _linears(model):
        total = total + _grid_linear(shape.mode, q, shape.depth, tokens, n_in, n_out, c, model.bias, link)
    local_tokens = tokens / grid.row_blocks
    norm = 16 * local_tokens + 2 * 2 * model.hidden * c / q
    norms = 2 * (norm / link.bandwidth + link.call(2 * math.ceil(math.log2(max(q, 2)))))
    return total + Traffic(norms, norms)


def edge_traffic(
    model: ModelShape, rows: float, c: int, shape: TPShape, link: Link, *, cp: int = 1
) -> Traffic:
    """Tensor-parallel communication of the embedding and the LM head with its loss."""
    t = shape.tp
    if t <= 1:
        return Traffic()
    tokens = rows * model.seq / cp
    if shape.mode == "1d":
        y = tokens * model.hidden * c
        loss = link.all_reduce(12 * tokens, t)
        return Traffic(link.all_reduce(y, t) + loss, link.all_reduce(y, t))
    q = shape.grid.side
    head = _grid_linear(shape.mode, q, shape.depth, tokens, model.hidden, model.vocab, c, False, link)
    tables = (model.vocab + model.seq) * model.hidden * c / q / link.bandwidth + 4 * q * link.call(1)
    return head + Traffic(tables, tables)


def context_traffic(
    model: ModelShape, rows: float, c: int, cp: int, mode: str, tp_split: int, link: Link
) -> Traffic:
    """Context-parallel communication of one attention layer (ring: overlappable)."""
    if cp <= 1:
        return Traffic()
    local = rows * model.seq / cp * model.hidden / tp_split * c  # one of q, k, v on this rank
    if mode == "ring":
        fwd = (cp - 1) * link.p2p(2 * local)
        return Traffic(0.0, 0.0, fwd, 2 * fwd)
    a2a = 4 * link.all_to_all(local, cp)
    return Traffic(a2a, a2a)
