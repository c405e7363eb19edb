"""Plans: which module of a model becomes which kind of tensor-parallel piece.

A plan maps module-name patterns to styles. A pattern is a dotted module name whose
components may use shell wildcards, one component each: ``layers.*.attn.q_proj`` matches
``layers.0.attn.q_proj`` but not ``layers.0.x.attn.q_proj``. ``resolve_plan`` turns a plan
and a model into a list of assignments and checks everything that can be checked without
communicating: every pattern matches a module, no module gets two styles, each style fits
its module's type, and every split size (features, heads, vocabulary) divides by tp. Each
failure is a ValueError naming the module and the numbers.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from torch import nn

from tessera.tensor_parallel.layers import dense_weights, is_dense
from tessera.tensor_parallel.partition import check_divisible

__all__ = [
    "Assignment",
    "Plan",
    "PlanLike",
    "Style",
    "attention_heads",
    "match_pattern",
    "resolve_plan",
    "unplanned_dropouts",
]


class Style(StrEnum):
    """What ``parallelize`` makes of a module (see README for the semantics of each)."""

    COLWISE = "colwise"  # Linear -> ColumnParallelLinear (output features split)
    COLWISE_GATHER = "colwise_gather"  # ... and all-gather its output (replicated output)
    COLWISE_QKV = "colwise_qkv"  # fused q|k|v Linear -> each third split (whole heads per rank)
    ROWWISE = "rowwise"  # Linear -> RowParallelLinear (input features split, input already parallel)
    VOCAB = "vocab"  # Embedding -> VocabParallelEmbedding
    REGION = "region"  # the module's input enters the tp region once (f, or SP all-gather)
    ATTENTION = "attention"  # REGION + heads split across ranks + split-stream RNG inside
    SEQUENCE_NORM = "sequence_norm"  # norm in the residual stream: partial grads under SP
    SEQUENCE_SPLIT = "sequence_split"  # under SP, keep this rank's slice of the output's sequence
    DROPOUT = "dropout"  # residual-stream Dropout: replicated stream, split stream under SP
    DROPOUT_SPLIT = "dropout_split"  # Dropout on split tensors (attention probabilities): split stream


COLWISE_STYLES = frozenset({Style.COLWISE, Style.COLWISE_GATHER, Style.COLWISE_QKV})
REGION_STYLES = frozenset({Style.REGION, Style.ATTENTION})
HEAD_ATTRIBUTES = ("num_heads", "n_heads", "num_attention_heads", "n_head")


@dataclass(frozen=True, slots=True)
class Plan:
    """An ordered, immutable plan. ``supports_sequence_parallel=False`` marks plans whose model
    cannot run with sequence-sharded activations (parallelize then refuses SP)."""

    entries: tuple[tuple[str, Style], ...]
    name: str = "custom"
    supports_sequence_parallel: bool = True

    @classmethod
    def of(
        cls,
        entries: Mapping[str, Style | str],
        *,
        name: str = "custom",
        supports_sequence_parallel: bool = True,
    ) -> Plan:
        """Build a plan from ``{pattern: style}``; an unknown style is a ValueError naming it."""
        out = []
        for pattern, style in entries.items():
            try:
                out.append((pattern, Style(style)))
            except ValueError:
                known = ", ".join(s.value for s in Style)
                raise ValueError(f"plan entry {pattern!r}: unknown style {style!r}; known: {known}") from None
        return cls(tuple(out), name, supports_sequence_parallel)

    def as_dict(self) -> dict[str, Style]:
        """The entries as ``{pattern: style}``."""
        return dict(self.entries)


PlanLike = Plan | Mapping[str, Style | str]


@dataclass(frozen=True, slots=True)
class Assignment:
    """One module's style, the pattern that chose it, and (colwise only) whether it must enter
    the tp region itself (False inside a REGION/ATTENTION module, which enters once for all)."""

    name: str
    style: Style
    pattern: str
    enter_region: bool = True


def match_pattern(pattern: str, name: str) -> bool:
    """Whether dotted ``name`` matches ``pattern`` component by component (shell wildcards)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(
        fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names, strict=True)
    )


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


def _is_within(name: str, ancestor: str) -> bool:
    return name.startswith(ancestor + ".")


def _check_module(name: str, style: Style, module: nn.Module, tp: int) -> None:
    where = f"{name} ({style.value})"
    kind = f"{type(module).__qualname__} (from {type(module).__module__})"
    if style in COLWISE_STYLES or style is Style.ROWWISE:
        if not is_dense(module):
            raise ValueError(f"{where}: expected torch.nn.Linear or HF Conv1D, got {kind}")
        out_f, in_f = dense_weights(module)[0].shape
        if style is Style.ROWWISE:
            check_divisible(int(in_f), tp, what="in_features", where=where)
        elif style is Style.COLWISE_QKV:
            check_divisible(int(out_f), 3, what="out_features (fused q, k, v)", where=where)
            check_divisible(int(out_f) // 3, tp, what="out_features/3", where=where)
        else:
            check_divisible(int(out_f), tp, what="out_features", where=where)
    elif style is Style.VOCAB:
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"{where}: expected torch.nn.Embedding, got {kind}")
        check_divisible(module.num_embeddings, tp, what="num_embeddings (vocab)", where=where)
    elif style in (Style.DROPOUT, Style.DROPOUT_SPLIT):
        if not isinstance(module, nn.Dropout):
            raise ValueError(f"{where}: expected torch.nn.Dropout, got {kind}")
    elif style is Style.SEQUENCE_NORM:
        if list(module.children()):
            raise ValueError(f"{where}: expected a norm layer (a module without submodules), got {kind}")
    elif style in REGION_STYLES:
        if is_dense(module) or isinstance(module, nn.Embedding | nn.Dropout):
            raise ValueError(f"{where}: expected a sublayer holding parallel layers, got {kind}")
        if style is Style.ATTENTION:
            heads = attention_heads(module)
            if heads is None:
                raise ValueError(
                    f"{where}: cannot tell the head count of {kind}: give it an int attribute "
                    f"{' / '.join(HEAD_ATTRIBUTES)}, or head_dim and a q_proj"
                )
            check_divisible(heads, tp, what="heads", where=where)


def resolve_plan(
    model: nn.Module, plan: PlanLike, *, tp: int, sequence_parallel: bool = False
) -> list[Assignment]:
    """Match ``plan`` against ``model`` and validate it for ``tp`` ranks (pure: no communication).

    Returns one Assignment per matched module, in ``named_modules()`` order.
    """
    plan = plan if isinstance(plan, Plan) else Plan.of(plan)
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if sequence_parallel and not plan.supports_sequence_parallel:
        raise ValueError(f"plan {plan.name!r} does not support sequence parallelism")
    modules = {name: m for name, m in model.named_modules() if name}
    chosen: dict[str, tuple[Style, str]] = {}
    for pattern, style in plan.entries:
        hits = [name for name in modules if match_pattern(pattern, name)]
        if not hits:
            sample = ", ".join(list(modules)[:8])
            raise ValueError(
                f"plan entry {pattern!r} ({style.value}) matches no module of {type(model).__name__}; "
                f"its modules are named like: {sample}"
            )
        for name in hits:
            if name in chosen and chosen[name][0] is not style:
                other_style, other = chosen[name]
                raise ValueError(
                    f"conflicting plan entries for module {name!r}: {other!r} -> {other_style.value} and "
                    f"{pattern!r} -> {style.value}"
                )
            chosen.setdefault(name, (style, pattern))
    regions = [name for name, (style, _) in chosen.items() if style in REGION_STYLES]
    out = []
    for name in modules:
        if name not in chosen:
            continue
        style, pattern = chosen[name]
        _check_module(name, style, modules[name], tp)
        outer = [r for r in regions if _is_within(name, r)]
        if style in REGION_STYLES and outer:
            raise ValueError(
                f"conflicting plan entries: region {name!r} ({style.value}) lies inside region {outer[0]!r}"
            )
        if style in REGION_STYLES:
            inner = {chosen[n][0] for n in chosen if _is_within(n, name)}
            if not inner & COLWISE_STYLES or Style.ROWWISE not in inner:
                raise ValueError(
                    f"{name} ({style.value}): a region needs colwise and rowwise layers inside it; "
                    f"the plan gives it {sorted(s.value for s in inner) or 'none'}"
                )
        out.append(Assignment(name, style, pattern, enter_region=not (style in COLWISE_STYLES and outer)))
    return out


def unplanned_dropouts(model: nn.Module, assignments: Iterable[Assignment]) -> list[str]:
    """Names of ``nn.Dropout`` modules with p > 0 that no ``dropout``/``dropout_split`` entry
    covers: they would draw from the global generator (inside an ``attention`` module, from
    its split stream, which is wrong for dropout on the module's replicated output)."""
    planned = {a.name for a in assignments if a.style in (Style.DROPOUT, Style.DROPOUT_SPLIT)}
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Dropout) and m.p > 0 and name not in planned
    ]
