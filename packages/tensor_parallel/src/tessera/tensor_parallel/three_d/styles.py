"""The 3D styles: what ``parallelize`` makes of a Linear, LayerNorm, Embedding or attention
module over a q x q x q cube, registered as ``3d_linear``, ``3d_linear_back``,
``3d_classifier``, ``3d_layernorm``, ``3d_embedding``, ``3d_vocab_embedding`` and
``3d_attention``.

A 3D layer needs the cube's three lines, which a style finds in ``ApplyContext.mesh`` (a
mesh of tp_mode 3d); applying one without such a mesh is a ValueError saying so. A linear
layer maps the stream layout to the branch layout (``3d_linear``: q/k/v, fc_in, the
classifier) or back (``3d_linear_back``: out_proj, fc_out); see ``linear``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from torch import nn

from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.style import ApplyContext, BaseStyle, module_kind, register_style
from tessera.tensor_parallel.styles import attention_heads
from tessera.tensor_parallel.three_d.cube import Cube3D, check_cube_divisible, cube_side
from tessera.tensor_parallel.three_d.embedding import EMBEDDING_SPEC, Embedding3D
from tessera.tensor_parallel.three_d.layernorm import LayerNorm3D, norm_spec
from tessera.tensor_parallel.three_d.linear import Linear3D, bias_spec, check_linear_3d, weight_spec
from tessera.tensor_parallel.three_d.vocab_embedding import VOCAB_EMBEDDING_SPEC, VocabEmbedding3D
from tessera.tensor_parallel.two_d.embedding import check_plain_embedding

__all__ = [
    "Attention3DStyle",
    "Embedding3DStyle",
    "LayerNorm3DStyle",
    "Linear3DStyle",
    "Style3D",
    "Styles3D",
    "VocabEmbedding3DStyle",
    "register",
]


@dataclass(frozen=True, slots=True)
class Style3D(BaseStyle):
    """A 3D style: it converts for the cube of the mesh ``parallelize`` runs over."""

    def _cube(self, ctx: ApplyContext) -> Cube3D:
        where = f"{ctx.name} ({self.name})"
        if ctx.mesh is None:
            raise ValueError(
                f"{where}: a 3d style needs the cube's lines: parallelize over a mesh of tp_mode 3d"
            )
        cube = Cube3D.from_mesh(ctx.mesh)  # ValueError unless the mesh is a 3d one
        if cube.q**3 != ctx.tp:
            raise ValueError(f"{where}: the cube is {cube.q}x{cube.q}x{cube.q} but tp={ctx.tp}")
        return cube


@dataclass(frozen=True, slots=True)
class Linear3DStyle(Style3D):
    """nn.Linear -> Linear3D, stream to branch layout (``swapped``: branch to stream).
    ``classifier``: the LM head, whose logits are vocabulary-split along the a line (for
    ``cross_entropy_3d``); its size is called vocab. ``returns``: the output moved back to the
    input's layout (an adapter's ``lora_A``; ``linear.mirror``)."""

    swapped: bool = False
    classifier: bool = False
    returns: bool = False

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        q = cube_side(tp, where=where)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{where}: expected torch.nn.Linear, got {module_kind(module)}")
        if self.classifier:
            check_cube_divisible(module.out_features, q * q, what="vocab (out_features)", where=where)
        check_linear_3d(module.in_features, module.out_features, q, bias=module.bias is not None, where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.Linear)
        return Linear3D.from_dense(module, self._cube(ctx), swapped=self.swapped, returns=self.returns)

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return weight_spec(self.swapped) if param == "weight" else bias_spec(self.swapped)


@dataclass(frozen=True, slots=True)
class LayerNorm3DStyle(Style3D):
    """nn.LayerNorm (over the last dim) in the stream layout -> LayerNorm3D."""

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        q = cube_side(tp, where=where)
        if not isinstance(module, nn.LayerNorm) or len(module.normalized_shape) != 1:
            raise ValueError(f"{where}: expected torch.nn.LayerNorm over one dim, got {module_kind(module)}")
        affine = module.weight is not None
        check_cube_divisible(module.normalized_shape[0], q**3 if affine else q, what="hidden", where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.LayerNorm)
        return LayerNorm3D.from_dense(module, self._cube(ctx))

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return norm_spec()


@dataclass(frozen=True, slots=True)
class Embedding3DStyle(Style3D):
    """nn.Embedding -> Embedding3D (hidden split over the whole cube)."""

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        q = cube_side(tp, where=where)
        embedding = check_plain_embedding(module, where)
        check_cube_divisible(embedding.embedding_dim, q**3, what="embedding_dim", where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.Embedding)
        return Embedding3D.from_dense(module, self._cube(ctx))

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return EMBEDDING_SPEC


@dataclass(frozen=True, slots=True)
class VocabEmbedding3DStyle(Style3D):
    """nn.Embedding -> VocabEmbedding3D (vocabulary cut q*q ways over the a and b lines,
    hidden over c); its input must carry the batch first (token ids, not positions)."""

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        q = cube_side(tp, where=where)
        embedding = check_plain_embedding(module, where)
        check_cube_divisible(embedding.num_embeddings, q * q, what="num_embeddings (vocab)", where=where)
        check_cube_divisible(embedding.embedding_dim, q, what="embedding_dim", where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        assert isinstance(module, nn.Embedding)
        return VocabEmbedding3D.from_dense(module, self._cube(ctx))

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return VOCAB_EMBEDDING_SPEC


@dataclass(frozen=True, slots=True)
class Attention3DStyle(Style3D):
    """An attention module whose q/k/v projections are ``3d_linear`` and out projection
    ``3d_linear_back``: it runs unchanged on the local block of the branch layout (batch
    block ``b*q + c``, whole sequence, head block a: H/q heads), so only the head count is
    checked (q must divide it, so that hidden block a holds whole heads)."""

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        where = f"{name} ({self.name})"
        q = cube_side(tp, where=where)
        heads = attention_heads(module)
        if heads is None:
            raise ValueError(f"{where}: cannot tell the head count of {module_kind(module)}")
        check_cube_divisible(heads, q, what="heads", where=where)

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        return None


def register() -> None:
    """Register the 3D styles by name (idempotent; importing this module already has)."""
    for style in (
        Styles3D.LINEAR,
        Styles3D.LINEAR_BACK,
        Styles3D.CLASSIFIER,
        Styles3D.LAYERNORM,
        Styles3D.EMBEDDING,
        Styles3D.VOCAB_EMBEDDING,
        Styles3D.ATTENTION,
    ):
        register_style(style)


class Styles3D:
    """The 3D styles as constants, each registered under its ``name``."""

    LINEAR: Final = register_style(Linear3DStyle("3d_linear"))
    LINEAR_BACK: Final = register_style(Linear3DStyle("3d_linear_back", swapped=True))
    CLASSIFIER: Final = register_style(Linear3DStyle("3d_classifier", classifier=True))
    LAYERNORM: Final = register_style(LayerNorm3DStyle("3d_layernorm"))
    EMBEDDING: Final = register_style(Embedding3DStyle("3d_embedding"))
    VOCAB_EMBEDDING: Final = register_style(VocabEmbedding3DStyle("3d_vocab_embedding"))
    ATTENTION: Final = register_style(Attention3DStyle("3d_attention"))
