"""``RegionStyle``: a sublayer whose input enters the tp region once (the ``region`` style),
and an attention module whose heads are also split (``attention``): the hooks that enter
the region at the sublayer's input (``module_input``), the refinement of the colwise layers
inside under grouped-query attention and fused q|k|v, and the head-count attributes set to
one rank's share. ``tessera.tensor_parallel.styles`` registers both under their names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor, nn

from tessera.tensor_parallel.adapted import dense_core
from tessera.tensor_parallel.heads import (
    GROUP_ATTRIBUTES,
    HEAD_ATTRIBUTES,
    KV_HEAD_ATTRIBUTES,
    HeadLayout,
    head_layout,
    localize_config,
)
from tessera.tensor_parallel.layer_styles import Colwise
from tessera.tensor_parallel.layers import (
    ColumnParallelLinear,
    dense_weights,
    end_region,
    enter_region_of,
    is_dense,
)
from tessera.tensor_parallel.partition import check_divisible
from tessera.tensor_parallel.rng import RNGRegion
from tessera.tensor_parallel.style import ApplyContext, BaseStyle, Role, TPStyle, module_kind

__all__ = ["INPUT_KEYWORDS", "PER_RANK_ATTRIBUTES", "RegionStyle", "module_input"]

# int attributes of an ATTENTION module that count query heads or per-rank widths; divided by tp
# so code that reads them (e.g. HF GPT-2's split of its fused q|k|v by ``split_size``) sees its share.
PER_RANK_ATTRIBUTES = (*HEAD_ATTRIBUTES, "split_size", "all_head_size")


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
            sub = dense_core(sub)  # an adapted projection is as wide as its base layer
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
        int(dense_weights(dense_core(sub))[0].shape[0])
        for sub, style in inner.values()
        if style.role is Role.ENTER
        and is_dense(dense_core(sub))
        and isinstance(style, Colwise)
        and style.sections == 1
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
        sub = dense_core(sub)
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
