"""Megatron's column- and row-parallel linear layers, made of tessera.comm's operators.

For ``y = x W^T + b`` with ``W`` of shape (out, in):

- ``ColumnParallelLinear`` holds rows ``W[o0:o1]`` (a slice of the output features) and
  ``b[o0:o1]``; it reads the whole input and writes its slice of the output features.
- ``RowParallelLinear`` holds columns ``W[:, i0:i1]`` (a slice of the input features) and
  the whole ``b``; it reads its slice of the input features and sums the partial outputs
  over the group (an all-reduce, or with sequence parallelism a reduce-scatter along the
  sequence), then adds ``b``.

A column layer followed by a row layer (attention's q/k/v then output projection, the MLP)
needs one entry and one exit: no communication between them. A column layer over ``blocks``
whole blocks (grouped-query attention's K/V heads) fewer than the ranks holds one block that
``tp / blocks`` ranks share; the gradients of those copies are summed in backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import Group, all_reduce, gather_along, group_rank, group_size, overlappable, split_along
from tessera.comm.ops import apply_function
from tessera.tensor_parallel.heads import copied_rows, fused_head_indices
from tessera.tensor_parallel.init import linear_weights
from tessera.tensor_parallel.overlap import Region, Slot, overlaps, summed_linear
from tessera.tensor_parallel.partition import fused_shard_indices, shard_range
from tessera.tensor_parallel.sequence import enter_tp_region, exit_tp_region, mark_sequence_parallel

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "dense_weights",
    "end_region",
    "enter_region_of",
    "is_dense",
    "set_overlap",
    "sum_copy_grads",
]


def is_dense(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` or a Hugging Face ``Conv1D`` (a transposed linear)."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def dense_weights(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(weight, bias)`` of a dense layer in nn.Linear layout: weight (out, in)."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    if is_dense(module):  # HF Conv1D: y = x @ weight + bias, weight (in, out)
        weight = module.weight
        bias = module.bias
        assert isinstance(weight, Tensor)
        return weight.t(), bias if isinstance(bias, Tensor) else None
    raise TypeError(f"expected nn.Linear or Conv1D, got {type(module).__name__}")


class _SumCopies(torch.autograd.Function):
    """Identity forward; backward, the gradient of rows ``[start, end)`` summed over the ranks
    holding the same block (one all-reduce over the group of a ``(blocks, rows, ...)`` buffer,
    each rank's gradient in its block's slot, zeros elsewhere: exact, and every copy gets the
    same sum); the other rows' gradient passes unchanged."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group, block: int, blocks: int, start: int, end: int) -> Tensor:
        ctx.group, ctx.block, ctx.blocks, ctx.rows = group, block, blocks, (start, end)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None, None]:
        start, end = ctx.rows
        buf = grad.new_zeros((ctx.blocks, end - start, *grad.shape[1:]))
        buf[ctx.block] = grad[start:end]
        summed = all_reduce(buf, ctx.group, inplace=True)[ctx.block]
        if end - start < grad.shape[0]:
            summed = torch.cat([grad[:start], summed, grad[end:]])
        return summed, None, None, None, None, None


def sum_copy_grads(
    x: Tensor, group: Group, block: int, blocks: int, *, start: int = 0, end: int | None = None
) -> Tensor:
    """``x`` unchanged; in backward the gradient of its rows ``[start, end)`` (all by default)
    is summed over the ranks of ``group`` that pass the same ``block`` of ``blocks``
    (all-reduces ``blocks`` times those rows' gradient bytes)."""
    return apply_function(_SumCopies, x, group, block, blocks, start, x.shape[0] if end is None else end)


def _param(t: Tensor, dtype: torch.dtype | None, device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(t.detach().to(device=device, dtype=dtype).contiguous())


class ColumnParallelLinear(nn.Module):
    """A linear layer whose output features are split across ``group``.

    Forward it enters the tensor-parallel region (unless ``enter_region=False``, when an
    enclosing module already did): nothing moved, or with ``sequence_parallel`` an
    all-gather of the input along ``seq_dim``; backward that becomes an all-reduce (or a
    reduce-scatter) of the input gradient. With ``gather_output`` the output slices are
    all-gathered along the last dim (backward keeps this rank's slice). ``sections`` > 1
    treats the output as that many equal fused parts (q, k, v) and shards each part.
    ``blocks`` treats the output as that many indivisible blocks (grouped-query attention's
    KV heads): with ``tp`` dividing ``blocks`` each rank holds ``blocks/tp`` of them; with
    ``blocks`` dividing ``tp`` each holds block ``rank*blocks//tp``, the ``tp/blocks`` ranks holding
    the same block sum their weight and bias gradients in backward (one all-reduce of ``blocks``
    times the local gradient over the group), so the copies stay equal. A tuple of ``blocks``
    is a fused layer of parts of that many blocks each, all of one width (q|k|v under
    grouped-query attention: ``(heads, kv_heads, kv_heads)``), each part held as above and in
    order (``heads.fused_head_indices``); only the rows of copied parts sum their gradients.
    ``seed`` initialises the slice of ``torch.manual_seed(seed); nn.Linear(in, out)``;
    ``seed=None`` leaves the weights uninitialised (to be loaded).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: Group,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = -2,
        enter_region: bool = True,
        sections: int = 1,
        blocks: int | tuple[int, ...] | None = None,
        seed: int | None = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        n, rank = group_size(group), group_rank(group)
        where = type(self).__name__
        if sections > 1 and gather_output:
            raise ValueError(f"{where}: gather_output with sections={sections} would interleave the parts")
        parts = (blocks,) if isinstance(blocks, int) else blocks
        self.blocks, self.copies = blocks, 1 if parts is None else max(1, n // min(parts))
        # rows of the local weight that copy a block other ranks hold: (start, end, block, blocks)
        self._copied: list[tuple[int, int, int, int]] = []
        if parts is None:
            self._index = fused_shard_indices(
                out_features, sections, n, rank, what="out_features", where=where
            )
        else:
            if sections not in (1, len(parts)) or (gather_output and self.copies > 1):
                raise ValueError(
                    f"{where}: blocks={blocks} over tp={n} with sections={sections}, "
                    f"gather_output={gather_output} is not supported"
                )
            self._index = fused_head_indices(out_features, parts, n, rank, where=where)
            self._copied = copied_rows(out_features, parts, n, rank)
        self.in_features, self.out_features, self.sections = in_features, out_features, sections
        self.group, self.tp = group, n
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.seq_dim, self.enter_region = seq_dim, enter_region
        local = len(self._index)
        self._slot: Slot | None = None  # set by an enclosing region for one forward call
        self.overlap = True  # see enter_region_of; set_overlap switches a whole model
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(local, dtype=dtype, device=device)) if bias else None
        if seed is not None:
            w, b = linear_weights(in_features, out_features, bias=bias, seed=seed)
            self.load_full(w, b)

    def shard_of(self, name: str, full: Tensor) -> Tensor:
        """This rank's slice of the serial layer's ``weight`` (out, in) or ``bias`` (out,)."""
        expect = {"weight": (self.out_features, self.in_features), "bias": (self.out_features,)}[name]
        if tuple(full.shape) != expect:
            raise ValueError(
                f"{type(self).__name__}.shard_of({name!r}): shape {tuple(full.shape)} != {expect}"
            )
        return full.index_select(0, torch.tensor(self._index, device=full.device))

    @torch.no_grad()
    def load_full(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Copy this rank's slice of a full (out, in) weight and (out,) bias into the layer."""
        self.weight.copy_(self.shard_of("weight", weight))
        if self.bias is not None:
            if bias is None:
                raise ValueError(f"{type(self).__name__}.load_full: the layer has a bias, none given")
            self.bias.copy_(self.shard_of("bias", bias))

    @classmethod
    def from_dense(
        cls,
        module: nn.Module,
        *,
        group: Group,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = -2,
        enter_region: bool = True,
        sections: int = 1,
        blocks: int | tuple[int, ...] | None = None,
    ) -> ColumnParallelLinear:
        """This rank's slice of an nn.Linear (or HF Conv1D), on its device and in its dtype."""
        weight, bias = dense_weights(module)
        layer = cls(
            weight.shape[1],
            weight.shape[0],
            group=group,
            bias=bias is not None,
            gather_output=gather_output,
            sequence_parallel=sequence_parallel,
            seq_dim=seq_dim,
            enter_region=enter_region,
            sections=sections,
            blocks=blocks,
            seed=None,
            dtype=weight.dtype,
            device=weight.device,
        )
        layer.load_full(weight, bias)
        return layer

    def defer_weight_grads(self, region: Region | None) -> None:
        """Let ``region`` (one forward call of an enclosing region, see ``overlap``) compute this
        layer's weight gradients while its input-gradient all-reduce runs; None ends that.
        A layer whose copies sum their gradients over ranks keeps its own backward."""
        self._slot = None if region is None or self.copies > 1 else region.slot(self.weight, self.bias)

    def forward(self, x: Tensor) -> Tensor:
        slot = self._slot
        if self.enter_region:  # x feeds only the linear below: its gradient is a new tensor
            x = enter_region_of(
                [self],
                x,
                self.group,
                sequence_parallel=self.sequence_parallel,
                seq_dim=self.seq_dim,
                private=True,
            )
            slot, self._slot = self._slot, None
        if slot is not None and x is slot.region.input:
            y = slot.linear(x)
            if self.enter_region:
                slot.region.close()
        else:
            weight: Tensor = self.weight
            bias: Tensor | None = self.bias
            for start, end, block, blocks in self._copied:
                weight = sum_copy_grads(weight, self.group, block, blocks, start=start, end=end)
                if bias is not None:
                    bias = sum_copy_grads(bias, self.group, block, blocks, start=start, end=end)
            # an input of another dtype (an fp32 norm's output before a bf16 head: what transformers
            # keeps in fp32) is read in the weight's, as the module it replaced reads it
            y = F.linear(x.to(weight.dtype), weight, bias)
        if self.gather_output:
            y = gather_along(y, -1, self.group)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} ({len(self._index)} here), "
            f"tp={self.tp}, bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}, enter_region={self.enter_region}"
            + (f", sections={self.sections}" if self.sections > 1 else "")
            + (f", blocks={self.blocks} ({self.copies} copies)" if self.blocks is not None else "")
        )


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split across ``group``.

    With ``input_is_parallel=False`` it first keeps its slice of a replicated input (nothing
    moved; all-gather of the gradient backward). Forward it sums the partial products over
    the group: an all-reduce of the output (2x it), or with ``sequence_parallel`` a
    reduce-scatter along ``seq_dim`` (backward: nothing, or an all-gather), then adds the
    (replicated) bias. Under sequence parallelism the bias gradient is partial per rank and
    the bias is tagged for ``sync_sequence_parallel_grads``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: Group,
        bias: bool = True,
        input_is_parallel: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = -2,
        seed: int | None = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        n = group_size(group)
        self._start, self._end = shard_range(
            in_features, n, group_rank(group), what="in_features", where=type(self).__name__
        )
        self.in_features, self.out_features = in_features, out_features
        self.group, self.tp = group, n
        self.input_is_parallel, self.sequence_parallel, self.seq_dim = (
            input_is_parallel,
            sequence_parallel,
            seq_dim,
        )
        local = self._end - self._start
        self.chunks = 1  # > 1: the all-reduce in pieces overlapping the product (set_overlap)
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        if self.bias is not None and sequence_parallel:
            mark_sequence_parallel(self.bias)
        if seed is not None:
            w, b = linear_weights(in_features, out_features, bias=bias, seed=seed)
            self.load_full(w, b)

    def shard_of(self, name: str, full: Tensor) -> Tensor:
        """This rank's slice of the serial layer's ``weight`` (out, in), or the whole ``bias``."""
        expect = {"weight": (self.out_features, self.in_features), "bias": (self.out_features,)}[name]
        if tuple(full.shape) != expect:
            raise ValueError(
                f"{type(self).__name__}.shard_of({name!r}): shape {tuple(full.shape)} != {expect}"
            )
        return full[:, self._start : self._end] if name == "weight" else full

    @torch.no_grad()
    def load_full(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Copy this rank's slice of a full (out, in) weight and the whole bias into the layer."""
        self.weight.copy_(self.shard_of("weight", weight))
        if self.bias is not None:
            if bias is None:
                raise ValueError(f"{type(self).__name__}.load_full: the layer has a bias, none given")
            self.bias.copy_(self.shard_of("bias", bias))

    @classmethod
    def from_dense(
        cls,
        module: nn.Module,
        *,
        group: Group,
        input_is_parallel: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = -2,
    ) -> RowParallelLinear:
        """This rank's slice of an nn.Linear (or HF Conv1D), on its device and in its dtype."""
        weight, bias = dense_weights(module)
        layer = cls(
            weight.shape[1],
            weight.shape[0],
            group=group,
            bias=bias is not None,
            input_is_parallel=input_is_parallel,
            sequence_parallel=sequence_parallel,
            seq_dim=seq_dim,
            seed=None,
            dtype=weight.dtype,
            device=weight.device,
        )
        layer.load_full(weight, bias)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = split_along(x, -1, self.group)
        if self.chunks > 1 and not self.sequence_parallel and overlappable(x, self.group):
            y = summed_linear(x, self.weight, self.group, self.chunks)
            return y if self.bias is None else y + self.bias
        y = exit_tp_region(  # the partial product is a temporary: summed in place
            F.linear(x, self.weight),
            self.group,
            sequence_parallel=self.sequence_parallel,
            seq_dim=self.seq_dim,
            private=True,
        )
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self._end - self._start} here), "
            f"out_features={self.out_features}, tp={self.tp}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}"
        )


def enter_region_of(
    layers: Sequence[ColumnParallelLinear],
    x: Tensor,
    group: Group,
    *,
    sequence_parallel: bool,
    seq_dim: int = -2,
    private: bool = False,
) -> Tensor:
    """``enter_tp_region`` for the column ``layers`` that read the result: when a backward
    will run, the input gradient's all-reduce (with sequence parallelism its reduce-scatter)
    overlaps the weight gradients of those layers (``overlap``); call ``end_region(layers)``
    once they have run forward. ``private`` as for ``enter_tp_region``, on the plain path (the
    overlapped one reduces in place whenever those layers read the input: see ``Region``). A
    layer with ``overlap`` off (``set_overlap``) keeps the plain entry for the whole region,
    and so does a group whose collectives run within the call (``overlappable``: ranks that
    share memory), where there is nothing to overlap."""
    plain = not layers or not overlappable(x, group)  # nothing to gain where comm is synchronous
    if plain or not all(layer.overlap for layer in layers) or not overlaps(x):
        return enter_tp_region(
            x, group, sequence_parallel=sequence_parallel, seq_dim=seq_dim, private=private
        )
    region = Region(group, sequence_parallel=sequence_parallel, seq_dim=seq_dim)
    for layer in layers:
        layer.defer_weight_grads(region)
    return region.enter(x)


def end_region(layers: Sequence[ColumnParallelLinear]) -> None:
    """End what ``enter_region_of`` set up on ``layers`` for this forward call."""
    for layer in layers:
        if layer._slot is not None:
            layer._slot.region.close()
        layer.defer_weight_grads(None)


def set_overlap(model: nn.Module, enabled: bool, *, chunks: int | None = None) -> int:
    """Switch the overlapped region entry (``enter_region_of``) on or off for every
    ColumnParallelLinear in ``model``; returns how many. Off, the input-gradient all-reduce
    runs after the weight gradients, as in a plain graph (results equal to round-off).
    ``chunks``: every RowParallelLinear's exit without sequence parallelism runs in that many
    pieces of rows, each piece's all-reduce overlapping the next piece's product
    (``overlap.summed_linear``; 1 is one all-reduce after the whole product)."""
    if chunks is not None and chunks < 1:
        raise ValueError(f"set_overlap: chunks={chunks} must be >= 1")
    found = [m for m in model.modules() if isinstance(m, ColumnParallelLinear)]
    for layer in found:
        layer.overlap = enabled
    if chunks is not None:
        for row in model.modules():
            if isinstance(row, RowParallelLinear):
                row.chunks = chunks
    return len(found)
