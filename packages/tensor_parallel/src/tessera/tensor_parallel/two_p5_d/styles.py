"""The 2.5D styles: what ``parallelize`` makes of a Linear, LayerNorm, Embedding or attention
module over a q x q x d grid, registered as ``2.5d_linear``, ``2.5d_classifier``,
``2.5d_layernorm``, ``2.5d_embedding``, ``2.5d_vocab_embedding`` and ``2.5d_attention``.

Each is its 2D style's twin (the same checks, per depth layer) building the 2.5D layer over
the ``Grid2p5D`` it finds in ``ApplyContext.mesh`` (tp_mode 2.5d) or was bound to. ``check``
sees only tp, not the depth, so a registered (unbound) style checks the module's type only
(as for q = 1: every tp is 1 x 1 x tp) and ``apply`` checks the sizes against the mesh's real
q (a ValueError naming the numbers, before any communication, though after the modules
before it were converted); ``bind_2p5d(plan, grid)`` / ``parallelize_2p5d`` bind the depth so
that every check runs first. Shard specs are ``DepthShardSpec``s carrying the serial
tensor's shape and, bound, the depth; unbound, ``unshard`` finds q from the shape (see ``grid``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from torch import nn

from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.style import ApplyContext, BaseStyle, register_style
from tessera.tensor_parallel.two_d.embedding import EMBEDDING_SPEC
from tessera.tensor_parallel.two_d.grid import GridShardSpec
from tessera.tensor_parallel.two_d.layernorm import NORM_SPEC
from tessera.tensor_parallel.two_d.linear import BIAS_SPEC, WEIGHT_SPEC
from tessera.tensor_parallel.two_d.styles import (
    Attention2DStyle,
    Embedding2DStyle,
    LayerNorm2DStyle,
    Linear2DStyle,
    Style2D,
    VocabEmbedding2DStyle,
)
from tessera.tensor_parallel.two_d.vocab_embedding import VOCAB_EMBEDDING_SPEC
from tessera.tensor_parallel.two_p5_d.grid import DepthShardSpec, Grid2p5D, tesseract_side
from tessera.tensor_parallel.two_p5_d.layers import (
    Embedding2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    VocabEmbedding2p5D,
)

__all__ = ["Style2p5D", "Styles2p5D", "register"]


_LINEAR_2D: Final = Linear2DStyle("2d_linear")


@dataclass(frozen=True, slots=True)
class Style2p5D(BaseStyle):
    """A 2.5D style: ``twin`` is the 2D style whose checks and spec it reuses per depth layer
    (its kind also picks the 2.5D layer ``apply`` builds); ``grid`` / ``depth`` what it is
    bound to (None in the registry; see the module)."""

    twin: Style2D = _LINEAR_2D
    grid: Grid2p5D | None = None
    depth: int | None = None

    def _side(self, tp: int, where: str) -> int:
        depth = self.grid.d if self.grid is not None else self.depth
        if depth is None:
            return 1  # unbound: every tp is 1 x 1 x tp; apply checks the mesh's real q
        return tesseract_side(tp, depth, where=where)

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        q = self._side(tp, where)
        try:
            self.twin.check(module, name=name, tp=q * q)
        except ValueError as e:
            raise ValueError(f"{str(e).replace(self.twin.name, self.name)} (tp={tp}, q={q})") from None

    def _grid(self, ctx: ApplyContext) -> Grid2p5D:
        where = f"{ctx.name} ({self.name})"
        grid = self.grid
        if grid is None and ctx.mesh is not None:
            grid = Grid2p5D.from_mesh(ctx.mesh)  # ValueError unless the mesh is a 2.5d one
        if grid is None:
            raise ValueError(
                f"{where}: a 2.5d style needs the grid's row, column and depth groups: parallelize "
                "over a mesh of tp_mode 2.5d, or pass the plan through bind_2p5d(plan, grid)"
            )
        if grid.q * grid.q * grid.d != ctx.tp:
            raise ValueError(f"{where}: the grid is {grid.q}x{grid.q}x{grid.d} but tp={ctx.tp}")
        return grid

    def _spec(self, spec: GridShardSpec, module: nn.Module, param: str) -> DepthShardSpec:
        depth = self.grid.d if self.grid is not None else self.depth
        shape = tuple(getattr(module, param).shape)
        return DepthShardSpec(i_dim=spec.i_dim, j_dim=spec.j_dim, depth=depth, shape=shape)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        grid = self._grid(ctx)
        self.check(module, name=ctx.name, tp=grid.q * grid.q * grid.d)  # the real q (unbound)
        if isinstance(self.twin, Linear2DStyle):
            assert isinstance(module, nn.Linear)
            return Linear2p5D.from_dense(module, grid)
        if isinstance(self.twin, LayerNorm2DStyle):
            assert isinstance(module, nn.LayerNorm)
            return LayerNorm2p5D.from_dense(module, grid)
        if isinstance(self.twin, VocabEmbedding2DStyle):
            assert isinstance(module, nn.Embedding)
            return VocabEmbedding2p5D.from_dense(module, grid)
        if isinstance(self.twin, Embedding2DStyle):
            assert isinstance(module, nn.Embedding)
            return Embedding2p5D.from_dense(module, grid)
        return None  # attention: runs unchanged on its local block

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        if isinstance(self.twin, Linear2DStyle):
            return self._spec(WEIGHT_SPEC if param == "weight" else BIAS_SPEC, module, param)
        if isinstance(self.twin, LayerNorm2DStyle):
            return self._spec(NORM_SPEC, module, param)
        if isinstance(self.twin, VocabEmbedding2DStyle):
            return self._spec(VOCAB_EMBEDDING_SPEC, module, param)
        if isinstance(self.twin, Embedding2DStyle):
            return self._spec(EMBEDDING_SPEC, module, param)
        return None


def register() -> None:
    """Register the 2.5D styles by name (idempotent; importing this module already has)."""
    for style in (
        Styles2p5D.LINEAR,
        Styles2p5D.CLASSIFIER,
        Styles2p5D.LAYERNORM,
        Styles2p5D.EMBEDDING,
        Styles2p5D.VOCAB_EMBEDDING,
        Styles2p5D.ATTENTION,
    ):
        register_style(style)


class Styles2p5D:
    """The 2.5D styles as constants, each registered under its ``name``."""

    LINEAR: Final = register_style(Style2p5D("2.5d_linear", twin=Linear2DStyle("2d_linear")))
    CLASSIFIER: Final = register_style(
        Style2p5D("2.5d_classifier", twin=Linear2DStyle("2d_classifier", classifier=True))
    )
    LAYERNORM: Final = register_style(Style2p5D("2.5d_layernorm", twin=LayerNorm2DStyle("2d_layernorm")))
    EMBEDDING: Final = register_style(Style2p5D("2.5d_embedding", twin=Embedding2DStyle("2d_embedding")))
    VOCAB_EMBEDDING: Final = register_style(
        Style2p5D("2.5d_vocab_embedding", twin=VocabEmbedding2DStyle("2d_vocab_embedding"))
    )
    ATTENTION: Final = register_style(Style2p5D("2.5d_attention", twin=Attention2DStyle("2d_attention")))
