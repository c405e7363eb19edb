"""Megatron's parallel transformer sublayers: self-attention with heads split, and the MLP.

Both enter the tensor-parallel region once (f, or the all-gather along the sequence with
sequence parallelism), run column-parallel projections, and leave it once through the
row-parallel output projection (all-reduce, or reduce-scatter along the sequence). So each
moves one all-reduce of its (batch, seq, d_model) output forward and one of its input
gradient backward (or the equivalent all-gather + reduce-scatter pair).

Inputs are batch-first, ``(batch, seq, d_model)``; with sequence parallelism ``seq`` is this
rank's slice of the sequence. The serial twin of a block built with ``seed=s`` is the
reference block whose linear layers are ``seeded_linear(..., seed=s + i)`` in the order
documented on each class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import Group, group_size
from tessera.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    end_region,
    enter_region_of,
)
from tessera.tensor_parallel.partition import check_divisible
from tessera.tensor_parallel.rng import DropoutRNG, ParallelDropout, RNGRegion

__all__ = ["ParallelMLP", "ParallelSelfAttention"]

_SEQ = -2
Device = torch.device | str | None


def _dropout(p: float, rng: DropoutRNG | None, sequence_parallel: bool, where: str) -> nn.Module:
    if p == 0.0:
        return nn.Identity()
    if rng is None:
        raise ValueError(f"{where}: dropout={p} needs a DropoutRNG (rng=...)")
    return ParallelDropout(p, rng, RNGRegion.SPLIT if sequence_parallel else RNGRegion.REPLICATED)


def _column(
    i: int, o: int, group: Group, bias: bool, sp: bool, seed: int, dtype: torch.dtype | None, device: Device
) -> ColumnParallelLinear:
    return ColumnParallelLinear(
        i,
        o,
        group=group,
        bias=bias,
        sequence_parallel=sp,
        seq_dim=_SEQ,
        enter_region=False,
        seed=seed,
        dtype=dtype,
        device=device,
    )


def _row(
    i: int, o: int, group: Group, bias: bool, sp: bool, seed: int, dtype: torch.dtype | None, device: Device
) -> RowParallelLinear:
    return RowParallelLinear(
        i,
        o,
        group=group,
        bias=bias,
        input_is_parallel=True,
        sequence_parallel=sp,
        seq_dim=_SEQ,
        seed=seed,
        dtype=dtype,
        device=device,
    )


class ParallelMLP(nn.Module):
    """``drop(fc_out(gelu(fc_in(x))))`` with ``fc_in`` column- and ``fc_out`` row-parallel.

    Serial twin: ``fc_in = seeded_linear(d_model, hidden, seed=seed)``,
    ``fc_out = seeded_linear(hidden, d_model, seed=seed + 1)``. The residual dropout uses
    the replicated stream, or the split stream under sequence parallelism.
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        *,
        group: Group,
        bias: bool = True,
        dropout: float = 0.0,
        sequence_parallel: bool = False,
        rng: DropoutRNG | None = None,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.fc_in = _column(d_model, hidden, group, bias, sequence_parallel, seed, dtype, device)
        self.fc_out = _row(hidden, d_model, group, bias, sequence_parallel, seed + 1, dtype, device)
        self.drop = _dropout(dropout, rng, sequence_parallel, "ParallelMLP")

    def forward(self, x: Tensor) -> Tensor:
        # x feeds only linear layers: its gradient is reduced in place (see enter_tp_region)
        x = enter_region_of(
            [self.fc_in], x, self.group, sequence_parallel=self.sequence_parallel, private=True
        )
        h = self.fc_in(x)
        end_region([self.fc_in])
        out: Tensor = self.drop(self.fc_out(F.gelu(h)))
        return out


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention with ``n_heads / tp`` heads on each rank.

    ``q_proj``, ``k_proj``, ``v_proj`` are column-parallel (a rank's output columns are whole
    heads), ``out_proj`` row-parallel. Serial twin: the four projections are
    ``seeded_linear(d_model, d_model, seed=seed + i)`` for q, k, v, out (i = 0..3).
    Dropout on the attention probabilities runs under the split stream (``rng.fork``, which
    swaps the process-wide generator); the residual dropout as in ParallelMLP.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        group: Group,
        bias: bool = True,
        dropout: float = 0.0,
        sequence_parallel: bool = False,
        rng: DropoutRNG | None = None,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        tp = group_size(group)
        check_divisible(d_model, n_heads, what="d_model", where="ParallelSelfAttention (by n_heads)")
        check_divisible(n_heads, tp, what="n_heads", where="ParallelSelfAttention")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.head_dim, self.local_heads = d_model // n_heads, n_heads // tp
        self.dropout, self.rng = dropout, rng
        if dropout > 0 and rng is None:
            raise ValueError(f"ParallelSelfAttention: dropout={dropout} needs a DropoutRNG (rng=...)")
        self.q_proj, self.k_proj, self.v_proj = (
            _column(d_model, d_model, group, bias, sequence_parallel, seed + i, dtype, device)
            for i in range(3)
        )
        self.out_proj = _row(d_model, d_model, group, bias, sequence_parallel, seed + 3, dtype, device)
        self.resid_drop = _dropout(dropout, rng, sequence_parallel, "ParallelSelfAttention")

    def forward(self, x: Tensor) -> Tensor:
        # x feeds only linear layers: its gradient is reduced in place (see enter_tp_region)
        qkv = (self.q_proj, self.k_proj, self.v_proj)
        x = enter_region_of(qkv, x, self.group, sequence_parallel=self.sequence_parallel, private=True)
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.local_heads, self.head_dim).transpose(1, 2) for p in qkv)
        end_region(qkv)
        if self.training and self.dropout > 0 and self.rng is not None:
            with self.rng.fork(RNGRegion.SPLIT):  # heads are split: each rank its own masks
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        out: Tensor = self.resid_drop(self.out_proj(y))
        return out
