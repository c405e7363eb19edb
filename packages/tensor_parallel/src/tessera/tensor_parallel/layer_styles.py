"""The built-in styles that swap a layer for its tensor-parallel twin: ``Colwise`` and
``Rowwise`` (Linear / HF Conv1D -> column / row parallel) and ``Vocab`` (Embedding ->
vocabulary parallel). ``tessera.tensor_parallel.styles`` registers them under their names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from tessera.tensor_parallel.embedding import VocabParallelEmbedding
from tessera.tensor_parallel.heads import FusedHeadShardSpec, HeadShardSpec
from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, dense_weights, is_dense
from tessera.tensor_parallel.partition import ShardSpec, check_divisible
from tessera.tensor_parallel.style import ApplyContext, BaseStyle, Role, module_kind

__all__ = ["Colwise", "Rowwise", "Vocab"]


def _check_dense(module: nn.Module, where: str) -> tuple[int, int]:
    if not is_dense(module):
        raise ValueError(f"{where}: expected torch.nn.Linear or HF Conv1D, got {module_kind(module)}")
    out_f, in_f = dense_weights(module)[0].shape
    return int(out_f), int(in_f)


def _is_conv(module: nn.Module) -> bool:
    return not isinstance(module, nn.Linear)  # HF Conv1D stores its weight (in, out)


@dataclass(frozen=True, slots=True)
class Colwise(BaseStyle):
    """Linear / Conv1D -> ColumnParallelLinear (output features split; ``sections`` equal fused
    parts each split; ``gather`` all-gathers the output; ``heads``: the output is that many
    whole KV heads, split or replicated over tp as ``heads.HeadLayout`` says: the ``attention``
    style gives its K/V projections this refinement under grouped-query attention; ``parts``:
    the output is fused parts of that many whole heads each, of one width, each split or
    replicated so (q|k|v: ``(heads, kv_heads, kv_heads)``, set by the ``attention`` style; the
    empty tuple: not yet told, refused outside an ``attention`` module)."""

    role: Role = Role.ENTER
    gather: bool = False
    sections: int = 1
    heads: int | None = None
    parts: tuple[int, ...] | None = None
    adapter_split: ClassVar[str] = "columns"  # how a layer's adapters split (``adapters.expand``)

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        out_f, _ = _check_dense(module, where)
        if self.parts is not None:
            self._check_parts(out_f, tp, where=where)
        elif self.heads is not None:
            check_divisible(out_f, self.heads, what="out_features", where=where, by=f"{self.heads} KV heads")
            if self.heads % tp and tp % self.heads:
                raise ValueError(f"{where}: kv_heads={self.heads} neither divides by nor divides tp={tp}")
            if self.sections > 1 or (self.gather and tp > self.heads):
                raise ValueError(
                    f"{where}: KV heads with fused sections or a gathered output are not supported"
                )
        elif self.sections > 1:
            n = self.sections
            if out_f % n:
                hint = " (a q|k|v of grouped KV heads is split by heads inside an 'attention' module)"
                raise ValueError(
                    f"{where}: out_features={out_f} is not {n} equal fused sections{hint * (n == 3)}"
                )
            if (out_f // n) % tp:
                raise ValueError(
                    f"{where}: out_features/{n}={out_f // n} (each of the {n} fused sections) is not "
                    f"divisible by tp={tp}"
                )
        else:
            check_divisible(out_f, tp, what="out_features", where=where)

    def _check_parts(self, out_f: int, tp: int, *, where: str) -> None:
        if not self.parts:
            raise ValueError(
                f"{where}: the heads of its fused q|k|v parts are told by the attention module it lies "
                "in: give that module the 'attention' style"
            )
        heads = sum(self.parts)
        if out_f % heads:
            raise ValueError(
                f"{where}: out_features={out_f} is not {heads} heads of one width "
                f"(fused parts of {', '.join(map(str, self.parts))} heads)"
            )
        for n in self.parts:
            if n % tp and tp % n:
                raise ValueError(
                    f"{where}: a fused part of {n} heads (of {', '.join(map(str, self.parts))}) neither "
                    f"divides by nor divides tp={tp}"
                )
        if self.gather and tp > min(self.parts):
            raise ValueError(
                f"{where}: fused parts of heads copied over tp and a gathered output are not supported"
            )

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        return ColumnParallelLinear.from_dense(
            module,
            group=ctx.group,
            gather_output=self.gather,
            sequence_parallel=ctx.sequence_parallel,
            seq_dim=ctx.seq_dim,
            enter_region=ctx.enter_region,
            sections=1 if self.parts else self.sections,
            blocks=self.parts or self.heads,
        )

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        conv = _is_conv(module) and param == "weight"
        if self.parts:
            return FusedHeadShardSpec(1 if conv else 0, transposed=conv, parts=self.parts)
        if self.heads is not None:
            return HeadShardSpec(1 if conv else 0, transposed=conv, heads=self.heads)
        return ShardSpec(1 if conv else 0, self.sections, transposed=conv)


@dataclass(frozen=True, slots=True)
class Rowwise(BaseStyle):
    """Linear / Conv1D -> RowParallelLinear (input features split, input already parallel)."""

    role: Role = Role.EXIT
    adapter_split: ClassVar[str] = "rows"

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        _, in_f = _check_dense(module, where)
        check_divisible(in_f, tp, what="in_features", where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        return RowParallelLinear.from_dense(
            module,
            group=ctx.group,
            input_is_parallel=True,
            sequence_parallel=ctx.sequence_parallel,
            seq_dim=ctx.seq_dim,
        )

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        if param != "weight":
            return None  # the bias is whole on every rank
        conv = _is_conv(module)
        return ShardSpec(0 if conv else 1, transposed=conv)


@dataclass(frozen=True, slots=True)
class Vocab(BaseStyle):
    """Embedding -> VocabParallelEmbedding (vocabulary rows split)."""

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"{where}: expected torch.nn.Embedding, got {module_kind(module)}")
        check_divisible(module.num_embeddings, tp, what="num_embeddings (vocab)", where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.Embedding)
        return VocabParallelEmbedding.from_embedding(
            module, group=ctx.group, sequence_parallel=ctx.sequence_parallel, seq_dim=ctx.seq_dim
        )

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return ShardSpec(0)
