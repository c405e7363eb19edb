"""The built-in 1D (Megatron) styles, registered under the names plans use (see README).

``Style`` names them as constants (``Style.COLWISE`` is the registered ``"colwise"`` style).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from torch import Tensor, nn

from tessera.tensor_parallel.embedding import VocabParallelEmbedding
from tessera.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, dense_weights, is_dense
from tessera.tensor_parallel.partition import ShardSpec, check_divisible
from tessera.tensor_parallel.rng import ParallelDropout, RNGRegion
from tessera.tensor_parallel.sequence import enter_tp_region, mark_sequence_parallel, scatter_to_sequence
from tessera.tensor_parallel.style import ApplyContext, BaseStyle, Role, register_style

__all__ = [
    "HEAD_ATTRIBUTES",
    "PER_RANK_ATTRIBUTES",
    "Colwise",
    "DropoutStyle",
    "RegionStyle",
    "Rowwise",
    "SequenceNorm",
    "SequenceSplit",
    "Style",
    "Vocab",
    "attention_heads",
]

HEAD_ATTRIBUTES = ("num_heads", "n_heads", "num_attention_heads", "n_head")
# int attributes of an ATTENTION module that count heads or per-rank widths; divided by tp so
# code that reads them (e.g. HF GPT-2's split of its fused q|k|v by ``split_size``) sees its share.
PER_RANK_ATTRIBUTES = (*HEAD_ATTRIBUTES, "split_size", "all_head_size")


def attention_heads(module: nn.Module) -> int | None:
    """The head count of an attention module: an int attribute ``num_heads`` (or ``n_heads``,
    ``num_attention_heads``, ``n_head``), else the width of ``q_proj`` over ``head_dim``."""
    for attr in HEAD_ATTRIBUTES:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    head_dim = getattr(module, "head_dim", None)
    q = getattr(module, "q_proj", None)
    if isinstance(head_dim, int) and isinstance(q, nn.Module) and is_dense(q):
        return int(dense_weights(q)[0].shape[0]) // head_dim
    return None


def _kind(module: nn.Module) -> str:
    return f"{type(module).__qualname__} (from {type(module).__module__})"


def _check_dense(module: nn.Module, where: str) -> tuple[int, int]:
    if not is_dense(module):
        raise ValueError(f"{where}: expected torch.nn.Linear or HF Conv1D, got {_kind(module)}")
    out_f, in_f = dense_weights(module)[0].shape
    return int(out_f), int(in_f)


def _is_conv(module: nn.Module) -> bool:
    return not isinstance(module, nn.Linear)  # HF Conv1D stores its weight (in, out)


@dataclass(frozen=True, slots=True)
class Colwise(BaseStyle):
    """Linear / Conv1D -> ColumnParallelLinear (output features split; ``sections`` fused parts
    each split; ``gather`` all-gathers the output)."""

    role: Role = Role.ENTER
    gather: bool = False
    sections: int = 1

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        out_f, _ = _check_dense(module, where)
        if self.sections > 1:
            check_divisible(out_f, self.sections, what="out_features (fused q, k, v)", where=where)
            check_divisible(out_f // self.sections, tp, what=f"out_features/{self.sections}", where=where)
        else:
            check_divisible(out_f, tp, what="out_features", where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        return ColumnParallelLinear.from_dense(
            module,
            group=ctx.group,
            gather_output=self.gather,
            sequence_parallel=ctx.sequence_parallel,
            seq_dim=ctx.seq_dim,
            enter_region=ctx.enter_region,
            sections=self.sections,
        )

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        conv = _is_conv(module) and param == "weight"
        return ShardSpec(1 if conv else 0, self.sections, transposed=conv)


@dataclass(frozen=True, slots=True)
class Rowwise(BaseStyle):
    """Linear / Conv1D -> RowParallelLinear (input features split, input already parallel)."""

    role: Role = Role.EXIT

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
            raise ValueError(f"{where}: expected torch.nn.Embedding, got {_kind(module)}")
        check_divisible(module.num_embeddings, tp, what="num_embeddings (vocab)", where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.Embedding)
        return VocabParallelEmbedding.from_embedding(
            module, group=ctx.group, sequence_parallel=ctx.sequence_parallel, seq_dim=ctx.seq_dim
        )

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return ShardSpec(0)


@dataclass(frozen=True, slots=True)
class DropoutStyle(BaseStyle):
    """Dropout -> ParallelDropout: replicated stream (split under SP), or always split."""

    role: Role = Role.DROPOUT
    split: bool = False

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        if not isinstance(module, nn.Dropout):
            raise ValueError(f"{name} ({self.name}): expected torch.nn.Dropout, got {_kind(module)}")

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.Dropout)
        split = ctx.sequence_parallel or self.split
        return ParallelDropout(module.p, ctx.rng, RNGRegion.SPLIT if split else RNGRegion.REPLICATED)


@dataclass(frozen=True, slots=True)
class SequenceNorm(BaseStyle):
    """A norm in the residual stream: under SP its parameters get partial gradients."""

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        if list(module.children()):
            kind = _kind(module)
            raise ValueError(
                f"{name} ({self.name}): expected a norm layer (a module without submodules), got {kind}"
            )

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        if ctx.sequence_parallel:
            for p in module.parameters():
                mark_sequence_parallel(p)
        return None


@dataclass(frozen=True, slots=True)
class SequenceSplit(BaseStyle):
    """Under SP, keep this rank's slice of the module output's sequence."""

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        if not ctx.sequence_parallel:
            return None
        name, group, seq_dim = ctx.name, ctx.group, ctx.seq_dim

        where = f"{name} ({self.name})"

        def hook(module: nn.Module, args: Any, output: Any) -> Tensor:
            if not isinstance(output, Tensor):
                raise TypeError(f"{where}: expected a Tensor output, got {type(output).__name__}")
            return scatter_to_sequence(output, group, seq_dim=seq_dim)

        module.register_forward_hook(hook)
        return None


@dataclass(frozen=True, slots=True)
class RegionStyle(BaseStyle):
    """The module's first input enters the tp region once (f, or the SP all-gather); with
    ``attention`` also its heads are split and its forward runs under the split dropout stream."""

    role: Role = Role.REGION
    attention: bool = False

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        if is_dense(module) or isinstance(module, nn.Embedding | nn.Dropout):
            raise ValueError(f"{where}: expected a sublayer holding parallel layers, got {_kind(module)}")
        if not self.attention:
            return
        heads = attention_heads(module)
        if heads is None:
            raise ValueError(
                f"{where}: cannot tell the head count of {_kind(module)}: give it an int attribute "
                f"{' / '.join(HEAD_ATTRIBUTES)}, or head_dim and a q_proj"
            )
        check_divisible(heads, tp, what="heads", where=where)
        for attr, value in _per_rank_attributes(module):
            check_divisible(value, tp, what=attr, where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        pre, post = _region_hooks(ctx, f"{ctx.name} ({self.name})", fork_split=self.attention)
        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, always_call=True)
        if self.attention:
            for attr, value in _per_rank_attributes(module):
                setattr(module, attr, value // ctx.tp)
        return None


_PreHook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], tuple[Any, dict[str, Any]]]


def _region_hooks(ctx: ApplyContext, where: str, *, fork_split: bool) -> tuple[_PreHook, Callable[..., None]]:
    """Hooks entering the tp region at the module's input (and, with ``fork_split``, running
    its forward in training under the split dropout stream, restored after)."""
    entered: list[bool] = []
    group, sp, seq_dim, rng = ctx.group, ctx.sequence_parallel, ctx.seq_dim, ctx.rng

    def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if not args or not isinstance(args[0], Tensor):
            raise TypeError(f"{where}: the input must be the first positional argument")
        x = enter_tp_region(args[0], group, sequence_parallel=sp, seq_dim=seq_dim)
        fork = fork_split and mod.training
        if fork:
            rng.enter(RNGRegion.SPLIT)
        entered.append(fork)
        return (x, *args[1:]), kwargs

    def post(mod: nn.Module, args: Any, output: Any) -> None:
        if entered and entered.pop():
            rng.exit()

    return pre, post


def _per_rank_attributes(module: nn.Module) -> list[tuple[str, int]]:
    out = []
    for attr in PER_RANK_ATTRIBUTES:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            out.append((attr, value))
    return out


class Style:
    """The built-in styles as constants, each registered under its ``name``."""

    COLWISE: Final = register_style(Colwise("colwise"))
    COLWISE_GATHER: Final = register_style(Colwise("colwise_gather", gather=True))
    COLWISE_QKV: Final = register_style(Colwise("colwise_qkv", sections=3))
    ROWWISE: Final = register_style(Rowwise("rowwise"))
    VOCAB: Final = register_style(Vocab("vocab"))
    REGION: Final = register_style(RegionStyle("region"))
    ATTENTION: Final = register_style(RegionStyle("attention", attention=True))
    SEQUENCE_NORM: Final = register_style(SequenceNorm("sequence_norm"))
    SEQUENCE_SPLIT: Final = register_style(SequenceSplit("sequence_split"))
    DROPOUT: Final = register_style(DropoutStyle("dropout"))
    DROPOUT_SPLIT: Final = register_style(DropoutStyle("dropout_split", split=True))
