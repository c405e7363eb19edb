"""The 2D styles: what ``parallelize`` makes of a Linear, LayerNorm, Embedding or attention
module over a q x q grid, registered as ``2d_linear``, ``2d_classifier``, ``2d_layernorm``,
``2d_embedding``, ``2d_vocab_embedding`` and ``2d_attention``.

A 2D layer needs the grid's row and column groups, which ``ApplyContext`` (tp group only)
does not carry: a style holds them as ``grid``. The registered styles have none (plans name
them and validate against them); ``bind_2d(plan, grid)`` (``plans``) gives each 2D entry its
grid before ``parallelize`` applies it. Applying an unbound 2D style is a ValueError saying so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from torch import nn

from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.style import ApplyContext, BaseStyle, module_kind, register_style
from tessera.tensor_parallel.styles import attention_heads
from tessera.tensor_parallel.two_d.embedding import EMBEDDING_SPEC, Embedding2D, check_plain_embedding
from tessera.tensor_parallel.two_d.grid import Grid2D, check_grid_divisible, grid_side
from tessera.tensor_parallel.two_d.layernorm import NORM_SPEC, LayerNorm2D
from tessera.tensor_parallel.two_d.linear import BIAS_SPEC, WEIGHT_SPEC, Linear2D, check_linear_2d
from tessera.tensor_parallel.two_d.vocab_embedding import VOCAB_EMBEDDING_SPEC, VocabEmbedding2D

__all__ = [
    "Attention2DStyle",
    "Embedding2DStyle",
    "LayerNorm2DStyle",
    "Linear2DStyle",
    "Style2D",
    "Styles2D",
    "VocabEmbedding2DStyle",
    "register",
]


@dataclass(frozen=True, slots=True)
class Style2D(BaseStyle):
    """A 2D style: ``grid`` is the grid it converts for (None in the registry; see the module)."""

    grid: Grid2D | None = None

    def _grid(self, ctx: ApplyContext) -> Grid2D:
        where = f"{ctx.name} ({self.name})"
        grid = self.grid
        if grid is None and ctx.mesh is not None:
            grid = Grid2D.from_mesh(ctx.mesh)  # ValueError unless the mesh is a 2d one
        if grid is None:
            raise ValueError(
                f"{where}: a 2d style needs the grid's row and column groups: parallelize over a mesh "
                "of tp_mode 2d, or pass the plan through bind_2d(plan, grid)"
            )
        if grid.q * grid.q != ctx.tp:
            raise ValueError(f"{where}: the grid is {grid.q}x{grid.q} but tp={ctx.tp}")
        return grid


@dataclass(frozen=True, slots=True)
class Linear2DStyle(Style2D):
    """nn.Linear -> Linear2D (SUMMA). ``classifier``: the LM head, whose output is
    vocabulary-split along the row (for ``cross_entropy_2d``); its size is called vocab."""

    classifier: bool = False

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        q = grid_side(tp, where=where)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{where}: expected torch.nn.Linear, got {module_kind(module)}")
        if self.classifier:
            check_grid_divisible(module.out_features, q, what="vocab (out_features)", where=where)
        check_linear_2d(module.in_features, module.out_features, q, bias=module.bias is not None, where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.Linear)
        return Linear2D.from_dense(module, self._grid(ctx))

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return WEIGHT_SPEC if param == "weight" else BIAS_SPEC


@dataclass(frozen=True, slots=True)
class LayerNorm2DStyle(Style2D):
    """nn.LayerNorm (over the last dim) -> LayerNorm2D."""

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        q = grid_side(tp, where=where)
        if not isinstance(module, nn.LayerNorm) or len(module.normalized_shape) != 1:
            raise ValueError(f"{where}: expected torch.nn.LayerNorm over one dim, got {module_kind(module)}")
        affine = module.weight is not None
        check_grid_divisible(module.normalized_shape[0], q * q if affine else q, what="hidden", where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.LayerNorm)
        return LayerNorm2D.from_dense(module, self._grid(ctx))

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return NORM_SPEC


@dataclass(frozen=True, slots=True)
class Embedding2DStyle(Style2D):
    """nn.Embedding -> Embedding2D (hidden split over the whole grid)."""

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        q = grid_side(tp, where=where)
        embedding = check_plain_embedding(module, where)
        check_grid_divisible(embedding.embedding_dim, q * q, what="embedding_dim", where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.Embedding)
        return Embedding2D.from_dense(module, self._grid(ctx))

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return EMBEDDING_SPEC


@dataclass(frozen=True, slots=True)
class VocabEmbedding2DStyle(Style2D):
    """nn.Embedding -> VocabEmbedding2D (vocabulary split over the rows, hidden over the
    columns); its input must carry the batch first (token ids, not positions)."""

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        q = grid_side(tp, where=where)
        embedding = check_plain_embedding(module, where)
        check_grid_divisible(embedding.num_embeddings, q, what="num_embeddings (vocab)", where=where)
        check_grid_divisible(embedding.embedding_dim, q, what="embedding_dim", where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.Embedding)
        return VocabEmbedding2D.from_dense(module, self._grid(ctx))

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return VOCAB_EMBEDDING_SPEC


@dataclass(frozen=True, slots=True)
class Attention2DStyle(Style2D):
    """An attention module whose q/k/v/out projections are 2D linears: it runs unchanged on
    the local block (batch block i, heads block j: H/q heads), so only the head count is
    checked (q must divide it, so that feature block j holds whole heads)."""

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        q = grid_side(tp, where=where)
        heads = attention_heads(module)
        if heads is None:
            raise ValueError(f"{where}: cannot tell the head count of {module_kind(module)}")
        check_grid_divisible(heads, q, what="heads", where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        return None


def register() -> None:
    """Register the 2D styles by name (idempotent; importing this module already has)."""
    for style in (
        Styles2D.LINEAR,
        Styles2D.CLASSIFIER,
        Styles2D.LAYERNORM,
        Styles2D.EMBEDDING,
        Styles2D.VOCAB_EMBEDDING,
        Styles2D.ATTENTION,
    ):
        register_style(style)


class Styles2D:
    """The 2D styles as constants, each registered under its ``name``."""

    LINEAR: Final = register_style(Linear2DStyle("2d_linear"))
    CLASSIFIER: Final = register_style(Linear2DStyle("2d_classifier", classifier=True))
    LAYERNORM: Final = register_style(LayerNorm2DStyle("2d_layernorm"))
    EMBEDDING: Final = register_style(Embedding2DStyle("2d_embedding"))
    VOCAB_EMBEDDING: Final = register_style(VocabEmbedding2DStyle("2d_vocab_embedding"))
    ATTENTION: Final = register_style(Attention2DStyle("2d_attention"))
