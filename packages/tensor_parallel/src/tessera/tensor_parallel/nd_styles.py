"""The styles the 2D, 2.5D and 3D modes turn roles into, beyond their GPT-shaped ones.

``modes`` maps each role of a plan to one of these or to a mode's own style (``2d_linear``,
``3d_vocab_embedding``, ...). What they add, for models that are not the reference GPT:

- ``DenseND``: an ``nn.Linear`` or HF ``Conv1D`` (weight (in, out)) as the mode's linear, and a
  fused q|k|v layer (``sections=3``) whose output features are reordered so each rank's block
  is ``[q | k | v]`` of the same heads (``FusedShardSpec`` records the reordering).
- ``NormND``: an ``nn.LayerNorm`` as the mode's exact LayerNorm (affine split); any other norm
  (RMSNorm, a user's own) run whole on the hidden: the local block's hidden is all-gathered
  along the line that splits it, the user's module runs with its whole weight, and the local
  block of its output is kept (backward: the reduce-scatter of the input gradient). Its
  parameters stay whole; their gradients are partial over the tp group (tagged with
  ``mark_sequence_parallel``, summed by ``sync_sequence_parallel_grads``).
- ``AttentionND``: an attention module run unchanged on its local block (whole sequences,
  H/q query heads, K/q KV heads): q must divide both (ValueError naming heads, kv_heads, q);
  its head-count attributes (and its ``config``'s, on a copy: ``heads.localize_config``) are set
  to this rank's. A fused q|k|v of grouped KV heads (parts of H, K, K heads) is refused: the
  fused layers' reordering cuts equal parts.
- ``TiedHead2D``: the LM head tied to a 2D/2.5D vocab embedding (``two_d.tied_head``).
- ``KeepND``: a module kept as it is (regions, ``replicate``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from tessera.comm import Group, Mesh, TPGrid, TPMode, all_gather_along, integer_root
from tessera.tensor_parallel.heads import (
    GROUP_ATTRIBUTES,
    HEAD_ATTRIBUTES,
    KV_HEAD_ATTRIBUTES,
    head_layout,
    localize_config,
)
from tessera.tensor_parallel.layers import dense_weights, is_dense
from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.region_style import PER_RANK_ATTRIBUTES
from tessera.tensor_parallel.sequence import mark_sequence_parallel
from tessera.tensor_parallel.style import ApplyContext, BaseStyle, TPStyle, module_kind
from tessera.tensor_parallel.two_d.grid import Grid2D
from tessera.tensor_parallel.two_d.linear import BIAS_SPEC
from tessera.tensor_parallel.two_d.tied_head import TiedClassifier2D, TiedClassifier2p5D
from tessera.tensor_parallel.two_d.vocab_embedding import VOCAB_EMBEDDING_SPEC
from tessera.tensor_parallel.two_p5_d.grid import DepthShardSpec, Grid2p5D
from tessera.tensor_parallel.two_p5_d.styles import Style2p5D

__all__ = [
    "AttentionND",
    "DenseND",
    "FusedShardSpec",
    "Geometry",
    "KeepND",
    "NormND",
    "TiedHead2D",
    "fused_order",
]

HiddenLine = Callable[[Mesh], tuple[int, Group, int]]
"""(q, the group along which the residual stream's hidden is split, this rank's index in it)."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the nD styles need of a mode: the mode, its ``depth`` (None: not known until the
    mesh is, 2.5D unbound) and ``hidden(mesh)``."""

    mode: TPMode
    hidden: HiddenLine
    depth: int | None = 1

    def side(self, tp: int, *, where: str) -> int | None:
        """q of ``tp`` ranks (``TPGrid``), None when the depth is not known; ValueError naming
        the numbers."""
        if self.depth is None:
            return None
        return TPGrid.of(self.mode, tp, self.depth, where=where).side


def fused_order(out: int, sections: int, q: int) -> list[int]:
    """Output features of a fused layer (``sections`` equal parts, each in q blocks) reordered
    block-major: block b of the result is part 0's block b, part 1's block b, ..."""
    part = out // sections
    blk = part // q
    return [s * part + b * blk + t for b in range(q) for s in range(sections) for t in range(blk)]


@dataclass(frozen=True, slots=True)
class FusedShardSpec(ShardSpec):
    """``inner`` (the mode's spec of an nn.Linear weight or bias) applied after the serial
    tensor is put in nn.Linear layout (``conv``: an HF Conv1D weight, stored (in, out)) and,
    with ``fused`` parts, its output features reordered by ``fused_order``. ``mode`` and
    ``depth`` tell q from tp (``shard``); ``unshard`` finds q from the shards' shapes."""

    dim: int = 0
    inner: ShardSpec | None = None
    fused: int = 1
    conv: bool = False
    mode: TPMode = TPMode.TWO_D
    depth: int | None = 1

    @property
    def local_dim(self) -> int:
        assert self.inner is not None
        return self.inner.local_dim

    def replicas(self, tp: int) -> int:
        """As ``inner``'s: reordering the output features copies nothing."""
        assert self.inner is not None
        return self.inner.replicas(tp)

    def __str__(self) -> str:
        parts = f", {self.fused} fused parts block-major" if self.fused > 1 else ""
        return f"{self.inner}{parts}{', from Conv1D (in, out)' if self.conv else ''}"

    def _linear(self, full: Tensor) -> Tensor:
        return full.t() if self.conv and full.dim() == 2 else full

    def shard(self, full: Tensor, rank: int, tp: int) -> Tensor:
        assert self.inner is not None
        t = self._linear(full)
        if self.fused > 1:
            if self.depth is None:
                raise ValueError(f"shard along {self}: the depth is unknown; bind it (plan_for_mode depth=)")
            q = TPGrid.of(self.mode, tp, self.depth, where=f"shard along {self}").side
            t = t.index_select(0, torch.tensor(fused_order(int(t.shape[0]), self.fused, q), device=t.device))
        return self.inner.shard(t, rank, tp)

    def unshard(self, shards: Sequence[Tensor]) -> Tensor:
        assert self.inner is not None
        t = self.inner.unshard(shards)
        if self.fused > 1:
            if t.dim() == 2:  # every mode splits the in features in q blocks
                q = int(t.shape[1]) // int(shards[0].shape[1])
            else:  # a bias: q*q chunks (3d: q**3); 2.5d's depth copies are not among them
                chunks = int(t.shape[0]) // int(shards[0].shape[0])
                root = integer_root(chunks, 3 if self.mode is TPMode.THREE_D else 2)
                if root is None:
                    raise ValueError(f"unshard along {self}: {chunks} bias chunks are not a {self.mode} grid")
                q = root
            order = torch.tensor(fused_order(int(t.shape[0]), self.fused, q), device=t.device)
            t = t.index_select(0, torch.argsort(order))
        return (t.t() if self.conv and t.dim() == 2 else t).contiguous()


def _view(module: nn.Module, *, sections: int = 1, q: int | None = None) -> nn.Linear:
    """``module`` (Linear / Conv1D) as an nn.Linear: on the meta device (shapes only) when
    ``q`` is None, else holding its weights, the output reordered by ``fused_order``."""
    w, b = dense_weights(module)
    out_f, in_f = (int(n) for n in w.shape)
    view = nn.Linear(in_f, out_f, bias=b is not None, device="meta", dtype=w.dtype)
    if q is None:
        return view
    if sections > 1:
        order = torch.tensor(fused_order(out_f, sections, q), device=w.device)
        w, b = w.index_select(0, order), None if b is None else b.index_select(0, order)
    view.weight = nn.Parameter(w.detach().contiguous(), requires_grad=False)
    if b is not None:
        view.bias = nn.Parameter(b.detach().contiguous(), requires_grad=False)
    return view


def _with_depth(style: TPStyle, depth: int) -> TPStyle:
    if isinstance(style, Style2p5D):
        return dataclasses.replace(style, depth=depth)
    if isinstance(style, DenseND | NormND | AttentionND | TiedHead2D):
        return style.with_depth(depth)
    return style


@dataclass(frozen=True, slots=True)
class DenseND(BaseStyle):
    """Linear / Conv1D (``sections`` fused parts) -> ``twin``'s layer (the mode's linear)."""

    twin: TPStyle | None = None
    geometry: Geometry | None = None
    sections: int = 1
    adapter_split: ClassVar[str] = "blocks"  # its adapters: two more of the mode's linears

    def _parts(self) -> tuple[TPStyle, Geometry]:
        assert self.twin is not None and self.geometry is not None, f"{self.name}: built without its twin"
        return self.twin, self.geometry

    def adapter_down(self) -> DenseND:
        """The style of an adapter's down projection ``lora_A`` (in -> r) on this layer: the
        mode's linear, unfused; under 3D one that returns its output to its input's layout, so
        that ``lora_B`` (this style) maps it where this layer's output lies."""
        twin, geo = self._parts()
        if geo.mode is TPMode.THREE_D:
            twin = dataclasses.replace(twin, returns=True)  # type: ignore[type-var]
        return dataclasses.replace(self, twin=twin, sections=1)

    def with_depth(self, depth: int) -> DenseND:
        """This style with the 2.5D depth known (every size checked before anything changes)."""
        twin, geo = self._parts()
        return dataclasses.replace(
            self, twin=_with_depth(twin, depth), geometry=dataclasses.replace(geo, depth=depth)
        )

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        twin, geo = self._parts()
        if not is_dense(module):
            raise ValueError(f"{where}: expected torch.nn.Linear or HF Conv1D, got {module_kind(module)}")
        view = _view(module)
        try:
            twin.check(view, name=name, tp=tp)
        except ValueError as e:
            raise ValueError(str(e).replace(twin.name, self.name)) from None
        q = geo.side(tp, where=where)
        if self.sections > 1 and q is not None and view.out_features % (self.sections * q):
            raise ValueError(
                f"{where}: out_features={view.out_features} is not {self.sections} fused parts "
                f"of q={q} blocks"
            )

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        twin, geo = self._parts()
        assert ctx.mesh is not None, f"{ctx.name} ({self.name}): needs the mesh"
        q, _, _ = geo.hidden(ctx.mesh)
        return twin.apply(_view(module, sections=self.sections, q=q), ctx)

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        twin, geo = self._parts()
        inner = twin.shard_spec(_view(module), param)
        conv = not isinstance(module, nn.Linear)
        if inner is None or (self.sections == 1 and not conv):
            return inner
        return FusedShardSpec(inner=inner, fused=self.sections, conv=conv, mode=geo.mode, depth=geo.depth)


@dataclass(frozen=True, slots=True)
class NormND(BaseStyle):
    """A norm in the residual stream: ``nn.LayerNorm`` -> ``exact`` (the mode's LayerNorm);
    any other norm module runs whole on the gathered hidden (see the module docstring)."""

    exact: TPStyle | None = None
    geometry: Geometry | None = None

    def with_depth(self, depth: int) -> NormND:
        """This style with the 2.5D depth known."""
        assert self.exact is not None and self.geometry is not None
        return dataclasses.replace(
            self,
            exact=_with_depth(self.exact, depth),
            geometry=dataclasses.replace(self.geometry, depth=depth),
        )

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        assert self.exact is not None and self.geometry is not None
        if isinstance(module, nn.LayerNorm):
            self.exact.check(module, name=name, tp=tp)
        elif list(module.children()) or is_dense(module) or isinstance(module, nn.Embedding | nn.Dropout):
            raise ValueError(f"{name} ({self.name}): expected a norm layer, got {module_kind(module)}")
        self.geometry.side(tp, where=f"{name} ({self.name})")

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert self.exact is not None and self.geometry is not None and ctx.mesh is not None
        if isinstance(module, nn.LayerNorm):
            return self.exact.apply(module, ctx)
        q, line, index = self.geometry.hidden(ctx.mesh)
        where = f"{ctx.name} ({self.name})"

        def gather(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            if not args or not isinstance(args[0], Tensor):
                raise TypeError(f"{where}: expected the hidden states as the first positional argument")
            return (all_gather_hidden(args[0], line), *args[1:])

        def keep(mod: nn.Module, args: Any, output: Any) -> Tensor:
            if not isinstance(output, Tensor):
                raise TypeError(f"{where}: expected a Tensor output, got {type(output).__name__}")
            return output.chunk(q, dim=-1)[index]

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(keep)
        for p in module.parameters():
            mark_sequence_parallel(p)
        return None

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        assert self.exact is not None
        return self.exact.shard_spec(module, param) if isinstance(module, nn.LayerNorm) else None


def all_gather_hidden(x: Tensor, line: Group) -> Tensor:
    """The whole hidden (last dim) of ``x`` from the ranks of ``line``; backward
    reduce-scatters the gradient (each rank's is a partial: it keeps one block of the output)."""
    return all_gather_along(x.contiguous(), x.dim() - 1, line)


@dataclass(frozen=True, slots=True)
class AttentionND(BaseStyle):
    """An attention module run unchanged on its local block; q must divide heads and KV heads."""

    geometry: Geometry | None = None

    def with_depth(self, depth: int) -> AttentionND:
        """This style with the 2.5D depth known."""
        assert self.geometry is not None
        return dataclasses.replace(self, geometry=dataclasses.replace(self.geometry, depth=depth))

    def _check(self, module: nn.Module, name: str, q: int) -> tuple[int, int]:
        where = f"{name} ({self.name})"
        layout = head_layout(module, where=where)
        if layout is None:
            raise ValueError(
                f"{where}: cannot tell the head count of {module_kind(module)}: give it an int "
                f"attribute {' / '.join(HEAD_ATTRIBUTES)}"
            )
        heads, kv = layout.heads, layout.kv_heads
        if heads % q or kv % q:
            raise ValueError(
                f"{where}: q must divide the query heads and the KV heads "
                f"(heads={heads}, kv_heads={kv}, q={q})"
            )
        fused = None if layout.head_dim is None else (heads + 2 * kv) * layout.head_dim
        for child, sub in module.named_children():
            if layout.grouped and is_dense(sub) and int(dense_weights(sub)[0].shape[0]) == fused:
                raise ValueError(
                    f"{where}: {child} is a fused q|k|v of grouped KV heads (heads={heads}, kv_heads={kv}), "
                    f"whose unequal parts tp mode {self.geometry.mode.value if self.geometry else '?'} "
                    "cannot reorder; use tp mode 1d, or separate q/k/v projections"
                )
        return heads, kv

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        assert self.geometry is not None
        q = self.geometry.side(tp, where=f"{name} ({self.name})")
        if q is not None:
            self._check(module, name, q)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert self.geometry is not None and ctx.mesh is not None
        q, _, _ = self.geometry.hidden(ctx.mesh)
        heads, kv = self._check(module, ctx.name, q)
        for attr in PER_RANK_ATTRIBUTES:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, attr, value // q)
        for attr in KV_HEAD_ATTRIBUTES:
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, kv // q)
        for attr in GROUP_ATTRIBUTES:
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, heads // kv)
        localize_config(module, heads // q, kv // q)
        return None


@dataclass(frozen=True, slots=True)
class TiedHead2D(BaseStyle):
    """The LM head (nn.Linear, weight (vocab, hidden)) tied to a 2D / 2.5D vocab embedding ->
    ``TiedClassifier2D`` / ``TiedClassifier2p5D``, cut as the embedding's table."""

    depth_replicated: bool = False
    depth: int | None = None

    def with_depth(self, depth: int) -> TiedHead2D:
        """This style with the 2.5D depth known."""
        return dataclasses.replace(self, depth=depth)

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{where}: expected torch.nn.Linear, got {module_kind(module)}")
        mode, depth = (TPMode.TWO_P5_D, self.depth) if self.depth_replicated else (TPMode.TWO_D, 1)
        q = Geometry(mode, _hidden_2d, depth).side(tp, where=where)
        if q is not None:
            for what, n, d in (
                ("in_features", module.in_features, q),
                ("vocab (out_features)", module.out_features, q),
            ):
                if n % d:
                    raise ValueError(f"{where}: {what}={n} is not divisible by q={q}")

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.Linear) and ctx.mesh is not None
        if self.depth_replicated:
            return TiedClassifier2p5D.from_dense(module, Grid2p5D.from_mesh(ctx.mesh))
        return TiedClassifier2D.from_dense(module, Grid2D.from_mesh(ctx.mesh))

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        spec = VOCAB_EMBEDDING_SPEC if param == "weight" else BIAS_SPEC
        if not self.depth_replicated:
            return spec
        shape = tuple(getattr(module, param).shape)
        return DepthShardSpec(i_dim=spec.i_dim, j_dim=spec.j_dim, depth=self.depth, shape=shape)


@dataclass(frozen=True, slots=True)
class KeepND(BaseStyle):
    """A module kept as it is (a region, ``replicate``): it runs on the local block; its
    parameters, if any, stay whole and their gradients are summed over tp (coverage)."""


def _hidden_2d(mesh: Mesh) -> tuple[int, Group, int]:
    grid = Grid2D.from_mesh(mesh)
    return grid.q, grid.row, grid.j
