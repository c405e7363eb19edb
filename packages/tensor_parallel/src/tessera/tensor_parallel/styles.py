"""The built-in 1D (Megatron) styles, registered under the names plans use (see README).

``Style`` names them as constants (``Style.COLWISE`` is the registered ``"colwise"`` style).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from torch import Tensor, nn

from tessera.comm import gather_along
from tessera.tensor_parallel.embedding import VocabParallelEmbedding
from tessera.tensor_parallel.heads import (
    GROUP_ATTRIBUTES,
    HEAD_ATTRIBUTES,
    KV_HEAD_ATTRIBUTES,
    FusedHeadShardSpec,
    HeadLayout,
    HeadShardSpec,
    head_layout,
    localize_config,
)
from tessera.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    dense_weights,
    end_region,
    enter_region_of,
    is_dense,
)
from tessera.tensor_parallel.partition import ShardSpec, check_divisible
from tessera.tensor_parallel.rng import ParallelDropout, RNGRegion
from tessera.tensor_parallel.sequence import mark_sequence_parallel, scatter_to_sequence
from tessera.tensor_parallel.style import ApplyContext, BaseStyle, Role, TPStyle, module_kind, register_style

__all__ = [
    "HEAD_ATTRIBUTES",
    "INPUT_KEYWORDS",
    "PER_RANK_ATTRIBUTES",
    "Colwise",
    "DropoutStyle",
    "RegionStyle",
    "Rowwise",
    "SequenceEnd",
    "SequenceNorm",
    "SequenceSplit",
    "SequenceStart",
    "Style",
    "Vocab",
    "Whole",
    "attention_heads",
    "module_input",
]

# int attributes of an ATTENTION module that count query heads or per-rank widths; divided by tp
# so code that reads them (e.g. HF GPT-2's split of its fused q|k|v by ``split_size``) sees its share.
PER_RANK_ATTRIBUTES = (*HEAD_ATTRIBUTES, "split_size", "all_head_size")


def attention_heads(module: nn.Module) -> int | None:
    """The query head count of an attention module (``head_layout``), None if it does not say."""
    layout = head_layout(module)
    return None if layout is None else layout.heads


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


@dataclass(frozen=True, slots=True)
class DropoutStyle(BaseStyle):
    """Dropout -> ParallelDropout: replicated stream (split under SP), or always split."""

    role: Role = Role.DROPOUT
    split: bool = False

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        if not isinstance(module, nn.Dropout):
            raise ValueError(f"{name} ({self.name}): expected torch.nn.Dropout, got {module_kind(module)}")

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.Dropout)
        split = ctx.sequence_parallel or self.split
        return ParallelDropout(module.p, ctx.rng, RNGRegion.SPLIT if split else RNGRegion.REPLICATED)


@dataclass(frozen=True, slots=True)
class SequenceNorm(BaseStyle):
    """A norm in the residual stream: under SP its parameters get partial gradients."""

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        if list(module.children()):
            kind = module_kind(module)
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
    """Under SP, keep this rank's slice of the module output's sequence (the module itself
    computes on every rank what the serial one does: its gradient is complete)."""

    grad_complete: bool = True

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
class Whole:
    """``inner`` applied as without sequence parallelism: the module sees whole activations
    even under SP, so its kept-whole parameters have complete gradients. For what runs before
    ``sequence_start`` or after ``sequence_end`` in models whose own code reads the sequence
    length between layers (Hugging Face derives positions and masks from the embedding's
    output, GPT-2 reshapes after its final norm)."""

    name: str
    inner: TPStyle
    grad_complete: bool = True

    @property
    def role(self) -> Role:
        """The inner style's."""
        return self.inner.role

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        self.inner.check(module, name=name, tp=tp)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        return self.inner.apply(module, replace(ctx, sequence_parallel=False))

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return self.inner.shard_spec(module, param)


@dataclass(frozen=True, slots=True)
class SequenceEnd(SequenceNorm):
    """A norm (``sequence_norm``) whose output, under SP, is gathered to the whole sequence on
    every rank (backward: this rank's slice of the gradient): the final norm of a model that
    reshapes by the whole sequence after it; the LM head after it is then ``colwise_whole``."""

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        SequenceNorm.apply(self, module, ctx)
        if ctx.sequence_parallel:
            group, seq_dim = ctx.group, ctx.seq_dim
            module.register_forward_hook(lambda m, a, out: gather_along(out, seq_dim, group))
        return None


@dataclass(frozen=True, slots=True)
class SequenceStart(BaseStyle):
    """Under SP, the module's input (``module_input``) is split to this rank's slice of the
    sequence: the first decoder layer of a model whose embedding output stays whole
    (``vocab_whole``), so the model's own positions and masks see the whole sequence. What
    runs before it is whole on every rank (``replicate``, ``dropout_whole``)."""

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        if not ctx.sequence_parallel:
            return None
        where, group, seq_dim = f"{ctx.name} ({self.name})", ctx.group, ctx.seq_dim

        def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            at = module_input(args, kwargs, where=where)
            x = args[0] if isinstance(at, int) else kwargs[at]
            x = scatter_to_sequence(x, group, seq_dim=seq_dim)
            return ((x, *args[1:]), kwargs) if isinstance(at, int) else (args, {**kwargs, at: x})

        module.register_forward_pre_hook(pre, with_kwargs=True)
        return None


@dataclass(frozen=True, slots=True)
class RegionStyle(BaseStyle):
    """The module's input (``module_input``) enters the tp region once (f, or the SP
    all-gather); with ``attention`` also its heads are split (``heads.HeadLayout``: query heads
    split, KV heads split or replicated), its head-count attributes set to this rank's, and
    its forward run under the split dropout stream."""

    role: Role = Role.REGION
    attention: bool = False
    kv_heads: int | None = None  # set by ``refine_inner`` when the projections' widths tell
    head_dim: int | None = None

    def layout(self, module: nn.Module, *, name: str) -> HeadLayout:
        """The attention module's heads; ValueError when it does not say."""
        layout = head_layout(module, where=f"{name} ({self.name})")
        if layout is not None and self.kv_heads is not None:
            return HeadLayout(layout.heads, self.kv_heads, self.head_dim or layout.head_dim)
        if layout is None:
            raise ValueError(
                f"{name} ({self.name}): cannot tell the head count of {module_kind(module)}: give it an int "
                f"attribute {' / '.join(HEAD_ATTRIBUTES)}, a config.num_attention_heads, "
                "or head_dim and a q_proj"
            )
        return layout

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        if is_dense(module) or isinstance(module, nn.Embedding | nn.Dropout):
            kind = module_kind(module)
            raise ValueError(f"{where}: expected a sublayer holding parallel layers, got {kind}")
        if not self.attention:
            return
        self.layout(module, name=name).check(tp, where=where)
        for attr, value in _ints(module, PER_RANK_ATTRIBUTES):
            check_divisible(value, tp, what=attr, where=where)

    def refine_inner(
        self, module: nn.Module, inner: Mapping[str, tuple[nn.Module, TPStyle]], *, name: str, tp: int
    ) -> dict[str, TPStyle]:
        """Under grouped-query attention, the colwise layers inside whose width is the KV heads'
        (the K and V projections) split by whole KV heads, replicated when fewer than tp, and a
        fused q|k|v layer (``colwise_qkv``) by its parts of ``(heads, kv_heads, kv_heads)`` whole
        heads; ``colwise_qkv_heads`` is told its parts' heads with or without grouping. Where the
        module names no KV head count, the projections' widths tell it (``kv_widths``); the
        refined attention style itself is returned under the key ``""``."""
        if not self.attention:
            return {}
        where = f"{name} ({self.name})"
        layout = self.layout(module, name=name)
        out = dict[str, TPStyle]()
        if not layout.grouped:
            inferred = kv_widths(layout, inner)
            if inferred is not None:
                inferred.check(tp, where=where)
                layout = inferred
                out[""] = replace(self, kv_heads=layout.kv_heads, head_dim=layout.head_dim)
        if layout.grouped and layout.head_dim is None:
            raise ValueError(
                f"{where}: grouped-query attention (heads={layout.heads}, kv_heads={layout.kv_heads}) "
                "needs the head width: give the module an int head_dim"
            )
        out |= _fused_qkv(layout, inner, name=name)
        if not layout.grouped:
            return out
        assert layout.head_dim is not None
        kv_width = layout.kv_heads * layout.head_dim
        for child, (sub, style) in inner.items():
            if style.role is not Role.ENTER or not is_dense(sub) or child in out:
                continue
            if int(dense_weights(sub)[0].shape[0]) != kv_width:
                continue
            if not isinstance(style, Colwise) or style.sections > 1 or style.gather:
                raise ValueError(
                    f"{name}.{child} ({style.name}): a K/V projection of grouped-query attention "
                    f"(heads={layout.heads}, kv_heads={layout.kv_heads}, tp={tp}) must be plain colwise"
                )
            out[child] = replace(style, heads=layout.kv_heads)
        return out

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        pre, post = _region_hooks(ctx, f"{ctx.name} ({self.name})", fork_split=self.attention)
        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, always_call=True)
        if self.attention:
            self.localize(module, name=ctx.name, tp=ctx.tp)
        return None

    def localize(self, module: nn.Module, *, name: str, tp: int) -> list[str]:
        """Set an attention module's head-count and width attributes to one rank's share of
        ``tp``; return the names of the attributes changed."""
        heads, kv = self.layout(module, name=name).local(tp)
        new = {a: v // tp for a, v in _ints(module, PER_RANK_ATTRIBUTES)}
        new |= {a: kv for a, _ in _ints(module, KV_HEAD_ATTRIBUTES)}
        new |= {a: heads // kv for a, _ in _ints(module, GROUP_ATTRIBUTES)}
        for attr, value in new.items():
            setattr(module, attr, value)
        return [*new, *localize_config(module, heads, kv)]


# keyword names a sublayer's input is looked up under when it is not passed positionally
INPUT_KEYWORDS = ("hidden_states", "x", "input", "inputs", "hidden")


def module_input(args: tuple[Any, ...], kwargs: Mapping[str, Any], *, where: str) -> int | str:
    """Where a sublayer's input is in a call: the first positional argument (index 0) if there
    is one; else the first of ``INPUT_KEYWORDS`` given as a keyword (``hidden_states`` for Hugging
    Face); else the only Tensor keyword argument. Anything else is a TypeError naming the keywords."""
    if args:
        if not isinstance(args[0], Tensor):
            raise TypeError(f"{where}: the input must be a Tensor, got {type(args[0]).__name__} first")
        return 0
    for key in INPUT_KEYWORDS:
        if isinstance(kwargs.get(key), Tensor):
            return key
    tensors = [k for k, v in kwargs.items() if isinstance(v, Tensor)]
    if len(tensors) == 1:
        return tensors[0]
    raise TypeError(
        f"{where}: cannot tell the input: pass it first positionally or as one of "
        f"{', '.join(INPUT_KEYWORDS)}= (called with keywords {sorted(kwargs) or 'none'})"
    )


_PreHook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], tuple[Any, dict[str, Any]]]


def _region_hooks(ctx: ApplyContext, where: str, *, fork_split: bool) -> tuple[_PreHook, Callable[..., None]]:
    """Hooks entering the tp region at the module's input (``module_input``: positional or by
    keyword) and, with ``fork_split``, running its forward in training under the split dropout
    stream, restored after."""
    entered: list[bool] = []
    group, sp, seq_dim, rng = ctx.group, ctx.sequence_parallel, ctx.seq_dim, ctx.rng
    inner: list[ColumnParallelLinear] = []  # the column layers the region enters for, found once

    def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        at = module_input(args, kwargs, where=where)
        if not inner:
            inner.extend(
                m for m in mod.modules() if isinstance(m, ColumnParallelLinear) and not m.enter_region
            )
        x = args[0] if isinstance(at, int) else kwargs[at]
        x = enter_region_of(inner, x, group, sequence_parallel=sp, seq_dim=seq_dim)
        if isinstance(at, int):
            args = (x, *args[1:])
        else:
            kwargs = {**kwargs, at: x}
        fork = fork_split and mod.training
        if fork:
            rng.enter(RNGRegion.SPLIT)
        entered.append(fork)
        return args, kwargs

    def post(mod: nn.Module, args: Any, output: Any) -> None:
        end_region(inner)
        if entered and entered.pop():
            rng.exit()

    return pre, post


def kv_widths(layout: HeadLayout, inner: Mapping[str, tuple[nn.Module, TPStyle]]) -> HeadLayout | None:
    """Grouped-query attention read from the projections when the module's attributes do not
    say: of the plain colwise layers inside, the widest is the queries' (``heads`` x head_dim)
    and all the narrower ones share one width, a whole number of heads (the K and V
    projections); None when the widths do not tell that story."""
    widths = {
        int(dense_weights(sub)[0].shape[0])
        for sub, style in inner.values()
        if style.role is Role.ENTER and is_dense(sub) and isinstance(style, Colwise) and style.sections == 1
    }
    if len(widths) != 2:
        return None
    kv_width, q_width = sorted(widths)
    head_dim = layout.head_dim or q_width // layout.heads
    if head_dim < 1 or head_dim * layout.heads != q_width or kv_width % head_dim:
        return None
    kv = kv_width // head_dim
    return HeadLayout(layout.heads, kv, head_dim) if layout.heads % kv == 0 else None


def _fused_qkv(
    layout: HeadLayout, inner: Mapping[str, tuple[nn.Module, TPStyle]], *, name: str
) -> dict[str, TPStyle]:
    """The fused q|k|v layers inside an attention module given their parts' heads: every
    ``colwise_qkv_heads`` (``Colwise`` with ``parts=()``), and under grouped-query attention every
    ``colwise_qkv`` (three equal sections would cut across heads); ValueError when a layer's
    width is not ``(heads + 2 kv_heads) x head_dim``."""
    out = dict[str, TPStyle]()
    parts = layout.qkv_parts
    for child, (sub, style) in inner.items():
        if not isinstance(style, Colwise) or not is_dense(sub) or style.heads is not None:
            continue
        if style.parts != () and not (style.parts is None and style.sections == 3 and layout.grouped):
            continue
        width = int(dense_weights(sub)[0].shape[0])
        if layout.head_dim is not None and width != sum(parts) * layout.head_dim:
            raise ValueError(
                f"{name}.{child} ({style.name}): a fused q|k|v projection of {width} output features is not "
                f"(heads + 2 kv_heads) x head_dim = {sum(parts) * layout.head_dim} (heads={layout.heads}, "
                f"kv_heads={layout.kv_heads}, head_dim={layout.head_dim})"
            )
        out[child] = replace(style, sections=3, parts=parts)
    return out


def _ints(module: nn.Module, attrs: tuple[str, ...]) -> list[tuple[str, int]]:
    out = []
    for attr in attrs:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            out.append((attr, value))
    return out


class Style:
    """The built-in styles as constants, each registered under its ``name``."""

    COLWISE: Final = register_style(Colwise("colwise"))
    COLWISE_GATHER: Final = register_style(Colwise("colwise_gather", gather=True))
    COLWISE_QKV: Final = register_style(Colwise("colwise_qkv", sections=3))
    COLWISE_QKV_HEADS: Final = register_style(Colwise("colwise_qkv_heads", sections=3, parts=()))
    COLWISE_GATE_UP: Final = register_style(Colwise("colwise_gate_up", sections=2))
    ROWWISE: Final = register_style(Rowwise("rowwise"))
    VOCAB: Final = register_style(Vocab("vocab"))
    REGION: Final = register_style(RegionStyle("region"))
    ATTENTION: Final = register_style(RegionStyle("attention", attention=True))
    SEQUENCE_NORM: Final = register_style(SequenceNorm("sequence_norm"))
    SEQUENCE_SPLIT: Final = register_style(SequenceSplit("sequence_split"))
    DROPOUT: Final = register_style(DropoutStyle("dropout"))
    DROPOUT_SPLIT: Final = register_style(DropoutStyle("dropout_split", split=True))
    SEQUENCE_START: Final = register_style(SequenceStart("sequence_start"))
    SEQUENCE_END: Final = register_style(SequenceEnd("sequence_end"))
    VOCAB_WHOLE: Final = register_style(Whole("vocab_whole", inner=VOCAB))
    COLWISE_WHOLE: Final = register_style(Whole("colwise_whole", inner=COLWISE))
    DROPOUT_WHOLE: Final = register_style(Whole("dropout_whole", inner=DROPOUT))
    EMBEDDING_WHOLE: Final = register_style(Whole("embedding_whole", inner=SequenceSplit("embedding")))
