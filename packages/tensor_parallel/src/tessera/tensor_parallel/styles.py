"""The built-in 1D (Megatron) styles, registered under the names plans use (see README).

``Style`` names them as constants (``Style.COLWISE`` is the registered ``"colwise"`` style).
Defined here: the dropout, sequence-parallel and ``Whole`` styles; the layer styles
(``Colwise``, ``Rowwise``, ``Vocab``) are in ``layer_styles``, ``RegionStyle`` (``region``,
``attention``) in ``region_style``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Final

from torch import Tensor, nn

from tessera.comm import gather_along
from tessera.tensor_parallel.heads import HEAD_ATTRIBUTES, head_layout
from tessera.tensor_parallel.layer_styles import Colwise, Rowwise, Vocab
from tessera.tensor_parallel.partition import ShardSpec
from tessera.tensor_parallel.region_style import RegionStyle, module_input
from tessera.tensor_parallel.rng import ParallelDropout, RNGRegion
from tessera.tensor_parallel.sequence import mark_sequence_parallel, scatter_to_sequence
from tessera.tensor_parallel.style import ApplyContext, BaseStyle, Role, TPStyle, module_kind, register_style

__all__ = [
    "HEAD_ATTRIBUTES",
    "DropoutStyle",
    "SequenceEnd",
    "SequenceNorm",
    "SequenceSplit",
    "SequenceStart",
    "Style",
    "Whole",
    "attention_heads",
]


def attention_heads(module: nn.Module) -> int | None:
    """The query head count of an attention module (``head_layout``), None if it does not say."""
    layout = head_layout(module)
    return None if layout is None else layout.heads


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
