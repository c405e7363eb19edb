"""Plans: which module of a model becomes which kind of tensor-parallel piece.

A plan maps module-name patterns to styles. A pattern is a dotted module name whose
components may use shell wildcards, one component each: ``layers.*.attn.q_proj`` matches
``layers.0.attn.q_proj`` but not ``layers.0.x.attn.q_proj``. ``resolve_plan`` turns a plan
and a model into a list of assignments and checks everything that can be checked without
communicating: every pattern matches a module, no module gets two styles, each style fits
its module (the style's ``check``: type, and every split size divides by tp), and regions
hold layers that enter and exit the tp region. A region style that ``RefinesInner`` may
replace the styles inside it (attention under grouped-query attention splits its K/V
projections by whole KV heads). A layer carrying low-rank adapters (PEFT's LoRA) takes its
entry's colwise or rowwise style onto its parts (``adapters.expand``); a layer kept as a frozen
original beside trained copies (PEFT's ``modules_to_save``) gives its entry to each of them. Each failure is a
ValueError naming the module and the numbers. Styles are typed objects (``style``); plans
name them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn

from tessera.tensor_parallel.adapted import has_adapters, saved_copies
from tessera.tensor_parallel.adapters import expand
from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.style import RefinesInner, Role, TPStyle, style_named
from tessera.tensor_parallel.styles import HEAD_ATTRIBUTES, Style, attention_heads

__all__ = [
    "HEAD_ATTRIBUTES",
    "Assignment",
    "Plan",
    "PlanLike",
    "ResolvedPlan",
    "Style",
    "assigned_spec",
    "attention_heads",
    "match_pattern",
    "resolve",
    "resolve_plan",
    "self_contained",
    "unplanned_dropouts",
]


@dataclass(frozen=True, slots=True)
class Plan:
    """An ordered, immutable plan. ``supports_sequence_parallel=False`` marks plans whose model
    cannot run with sequence-sharded activations (parallelize then refuses SP). ``optional``:
    patterns of entries that may match no module (a module some configurations of a family do
    not build); every other entry matching nothing is an error."""

    entries: tuple[tuple[str, TPStyle], ...]
    name: str = "custom"
    supports_sequence_parallel: bool = True
    optional: frozenset[str] = frozenset()

    @classmethod
    def of(
        cls,
        entries: Mapping[str, TPStyle | str],
        *,
        name: str = "custom",
        supports_sequence_parallel: bool = True,
        optional: Iterable[str] = (),
    ) -> Plan:
        """Build a plan from ``{pattern: style}``, a style given as an object or by its registered
        name; an unknown name is a ValueError naming it, as is an ``optional`` pattern that is
        not one of the entries."""
        out = []
        for pattern, style in entries.items():
            try:
                out.append((pattern, style_named(style) if isinstance(style, str) else style))
            except ValueError as e:
                raise ValueError(f"plan entry {pattern!r}: {e}") from None
        maybe = frozenset(optional)
        stray = sorted(maybe - set(entries))
        if stray:
            raise ValueError(f"plan {name!r}: optional patterns {stray} are not entries of the plan")
        return cls(tuple(out), name, supports_sequence_parallel, maybe)

    def as_dict(self) -> dict[str, TPStyle]:
        """The entries as ``{pattern: style}``."""
        return dict(self.entries)


PlanLike = Plan | Mapping[str, TPStyle | str]


@dataclass(frozen=True, slots=True)
class Assignment:
    """One module's style, the pattern that chose it, and (ENTER role, e.g. colwise, only)
    whether it must enter the tp region itself (False inside a REGION-role module such as
    ``region``/``attention``, which enters once for all)."""

    name: str
    style: TPStyle
    pattern: str
    enter_region: bool = True


def match_pattern(pattern: str, name: str) -> bool:
    """Whether dotted ``name`` matches ``pattern`` component by component (shell wildcards)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(
        fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names, strict=True)
    )


def _is_within(name: str, ancestor: str) -> bool:
    return name.startswith(ancestor + ".")


def self_contained(style: TPStyle) -> bool:
    """Whether ``style`` (a REGION-role one) converts its module's whole subtree: it enters and
    leaves the tp region itself and says how its descendants' parameters are split
    (``shard_spec(module, "child.weight")``), so no plan entry names a module inside it (e.g.
    a mixture of experts split inside its experts). A style says so with ``self_contained = True``."""
    return bool(getattr(style, "self_contained", False))


def assigned_spec(
    by_name: Mapping[str, Assignment], model: nn.Module, full: str
) -> tuple[Assignment | None, ShardSpec | None]:
    """The assignment that decides serial parameter ``full``'s split, and the split (None:
    whole): its module's own, else that of the nearest self-contained ancestor region."""
    owner, _, pname = full.rpartition(".")
    a = by_name.get(owner)
    if a is not None:
        return a, a.style.shard_spec(model.get_submodule(owner) if owner else model, pname)
    parts = owner.split(".") if owner else []
    for i in range(len(parts) - 1, -1, -1):
        ancestor = ".".join(parts[:i])
        b = by_name.get(ancestor)
        if b is not None and self_contained(b.style):
            module = model.get_submodule(ancestor) if ancestor else model
            return b, b.style.shard_spec(module, full[len(ancestor) + 1 :] if ancestor else full)
    return None, None


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
    chosen: dict[str, tuple[TPStyle, str]] = {}
    for pattern, style in plan.entries:
        hits = [name for name in modules if match_pattern(pattern, name)]
        if not hits and pattern in plan.optional:
            continue
        if not hits:
            sample = ", ".join(list(modules)[:8])
            raise ValueError(
                f"plan entry {pattern!r} ({style.name}) matches no module of {type(model).__name__}; "
                f"its modules are named like: {sample}"
            )
        for name in hits:
            if name in chosen and chosen[name][0] is not style:
                other_style, other = chosen[name]
                raise ValueError(
                    f"conflicting plan entries for module {name!r}: {other!r} -> {other_style.name} and "
                    f"{pattern!r} -> {style.name}"
                )
            chosen.setdefault(name, (style, pattern))
    regions = [name for name, (style, _) in chosen.items() if style.role is Role.REGION]
    out = []
    for name in modules:
        if name not in chosen:
            continue
        style, pattern = chosen[name]
        copies = saved_copies(modules[name])
        if copies is not None and style.role is not Role.REGION:  # each copy is the layer
            for child in ("original_module", *(f"modules_to_save.{k}" for k in copies)):
                full = f"{name}.{child}"
                style.check(modules[full], name=full, tp=tp)
                within = any(_is_within(name, r) for r in regions)
                out.append(
                    Assignment(full, style, pattern, enter_region=not (style.role is Role.ENTER and within))
                )
            continue
        if has_adapters(modules[name]) and (
            style.role in (Role.ENTER, Role.EXIT) or hasattr(style, "adapter_split")
        ):
            out += _adapted(
                name, modules, style, pattern, regions, tp=tp, sequence_parallel=sequence_parallel
            )
            continue
        style.check(modules[name], name=name, tp=tp)
        if style.role is Role.REGION and isinstance(style, RefinesInner):  # e.g. attention's K/V under GQA
            nested = {n[len(name) + 1 :]: (modules[n], chosen[n][0]) for n in chosen if _is_within(n, name)}
            for child, refined in style.refine_inner(modules[name], nested, name=name, tp=tp).items():
                key = f"{name}.{child}" if child else name  # "" refines the region itself
                chosen[key] = (refined, chosen[key][1])
            style = chosen[name][0]
        outer = [r for r in regions if _is_within(name, r)]
        if style.role is Role.REGION and outer:
            raise ValueError(
                f"conflicting plan entries: region {name!r} ({style.name}) lies inside region {outer[0]!r}"
            )
        if style.role is Role.REGION and self_contained(style):
            inside = sorted(n for n in chosen if _is_within(n, name))
            if inside:
                raise ValueError(
                    f"{name} ({style.name}) converts its whole sublayer; the plan also gives modules "
                    f"inside it: {', '.join(inside[:4])}"
                )
        elif style.role is Role.REGION:
            inner = {chosen[n][0] for n in chosen if _is_within(n, name)}
            if not {Role.ENTER, Role.EXIT} <= {s.role for s in inner}:
                raise ValueError(
                    f"{name} ({style.name}): a region needs colwise and rowwise layers inside it; "
                    f"the plan gives it {sorted(s.name for s in inner) or 'none'}"
                )
        out.append(Assignment(name, style, pattern, enter_region=not (style.role is Role.ENTER and outer)))
    return out


def _adapted(
    name: str,
    modules: Mapping[str, nn.Module],
    style: TPStyle,
    pattern: str,
    regions: list[str],
    *,
    tp: int,
    sequence_parallel: bool,
) -> list[Assignment]:
    """The assignments of an adapted layer's parts (``adapters.expand``), each checked."""
    in_region = any(_is_within(name, r) for r in regions)
    out = []
    for child, sub in expand(
        name, modules[name], style, sequence_parallel=sequence_parallel, in_region=in_region
    ):
        full = f"{name}.{child}"
        sub.check(modules[full], name=full, tp=tp)
        out.append(Assignment(full, sub, pattern, enter_region=not (sub.role is Role.ENTER and in_region)))
    return out


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan matched against one model and validated for ``tp`` ranks (`resolve`): one
    `Assignment` per matched module, in ``named_modules()`` order. ``parallelize`` applies it as
    it is, so a caller that checks the assignments first (``boost()``) resolves the plan once."""

    plan: Plan
    assignments: tuple[Assignment, ...]
    tp: int
    sequence_parallel: bool


def resolve(model: nn.Module, plan: PlanLike, *, tp: int, sequence_parallel: bool = False) -> ResolvedPlan:
    """``plan`` matched against ``model`` for ``tp`` ranks (`resolve_plan`, kept with what it was
    resolved for); pure: ValueError naming the entry and the module when it does not fit."""
    plan = plan if isinstance(plan, Plan) else Plan.of(plan)
    assignments = resolve_plan(model, plan, tp=tp, sequence_parallel=sequence_parallel)
    return ResolvedPlan(plan, tuple(assignments), tp, sequence_parallel)


def unplanned_dropouts(model: nn.Module, assignments: Iterable[Assignment]) -> list[str]:
    """Names of ``nn.Dropout`` modules with p > 0 that no ``dropout``/``dropout_split`` entry
    covers: they would draw from the global generator (inside an ``attention`` module, from
    its split stream, which is wrong for dropout on the module's replicated output)."""
    planned = {a.name for a in assignments if a.style.role is Role.DROPOUT}
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Dropout) and m.p > 0 and name not in planned
    ]
