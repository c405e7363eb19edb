"""Tensor-parallel styles: what ``parallelize`` makes of one module, as typed objects.

A style is any object meeting the ``TPStyle`` protocol: a ``name`` (what plans write), a
``role`` (how it takes part in a tp region), ``check`` (pure validation against a module and
tp: a ValueError naming the module and the numbers), ``apply`` (convert the module: return
its parallel twin, or None after installing hooks in place) and ``shard_spec`` (for each of
the module's own parameters, how the serial tensor maps to every rank's shard, None when
kept whole). Styles live in a registry by name: ``register_style`` adds one (a research
extension registers its own, it does not edit Tessera), ``style_named`` looks one up. The
built-in 1D styles are in ``styles``; ``BaseStyle`` gives the defaults of a style that
shards nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from torch import nn

from tessera.comm import Group, Mesh
from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.rng import DropoutRNG

__all__ = [
    "ApplyContext",
    "BaseStyle",
    "RefinesInner",
    "Role",
    "TPStyle",
    "module_kind",
    "register_style",
    "registered_styles",
    "style_named",
]


def module_kind(module: nn.Module) -> str:
    """What a module is, for errors: ``Embedding (from tessera.models.gpt)``."""
    return f"{type(module).__qualname__} (from {type(module).__module__})"


class Role(StrEnum):
    """How a style's module takes part in a tp region (what plan validation needs to know)."""

    ENTER = "enter"  # takes its input into the tp region itself, unless inside a REGION (colwise)
    EXIT = "exit"  # leaves the tp region (rowwise)
    REGION = "region"  # a sublayer whose input enters once for the ENTER/EXIT layers inside it
    DROPOUT = "dropout"  # replaces an nn.Dropout (it then draws from a tp-aware stream)
    LOCAL = "local"  # anything else


@dataclass(frozen=True, slots=True)
class ApplyContext:
    """What ``apply`` needs besides the module: its name, the tp group and settings, the
    dropout streams, (ENTER role) whether it must enter the tp region itself, and the mesh
    (for styles that use more groups than tp's, e.g. a 2D grid's rows and columns)."""

    name: str
    group: Group
    tp: int
    sequence_parallel: bool
    seq_dim: int
    rng: DropoutRNG
    enter_region: bool = True
    mesh: Mesh | None = None


@runtime_checkable
class TPStyle(Protocol):
    """A tensor-parallel style (see the module docstring)."""

    @property
    def name(self) -> str: ...
    @property
    def role(self) -> Role: ...
    def check(self, module: nn.Module, *, name: str, tp: int) -> None: ...
    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None: ...
    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None: ...


@runtime_checkable
class RefinesInner(Protocol):
    """Optional, for REGION-role styles: given the region's module and the modules and styles
    the plan gives inside it (by name relative to the region), return styles that replace some
    of them (the ``attention`` style makes its K/V projections split by whole KV heads under
    grouped-query attention). Pure; ``resolve_plan`` calls it after the region's ``check`` and
    before the inner modules' checks."""

    def refine_inner(
        self, module: nn.Module, inner: Mapping[str, tuple[nn.Module, TPStyle]], *, name: str, tp: int
    ) -> dict[str, TPStyle]: ...


@dataclass(frozen=True, slots=True)
class BaseStyle:
    """Defaults for a style that shards nothing: no checks, module kept, parameters whole."""

    name: str
    role: Role = Role.LOCAL

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        return None

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        return None

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return None


_REGISTRY: dict[str, TPStyle] = {}


def register_style(style: TPStyle, *, replace: bool = False) -> TPStyle:
    """Make ``style`` usable by name in plans; return it. Another style under the same name
    is a ValueError unless ``replace``."""
    if not isinstance(style, TPStyle):
        raise TypeError(f"register_style: {style!r} does not meet the TPStyle protocol")
    other = _REGISTRY.get(style.name)
    if other is not None and other is not style and not replace:
        raise ValueError(f"a style named {style.name!r} is already registered: {other!r}")
    _REGISTRY[style.name] = style
    return style


def style_named(name: str) -> TPStyle:
    """The registered style called ``name``; ValueError listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown style {name!r}; known: {', '.join(_REGISTRY)}") from None


def registered_styles() -> dict[str, TPStyle]:
    """Every registered style by name, in registration order."""
    return dict(_REGISTRY)
