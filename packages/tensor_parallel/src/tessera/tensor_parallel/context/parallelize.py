"""Make a model context-parallel in place: route its attention, make its positions follow.

Two ways to find attention. By name (``context_parallelize`` with ``cores``): each
parameter-free core module called on (batch, heads, seq, head_dim) q, k, v (the reference
GPT's ``layers.*.attn.core``) is replaced by a ``ContextParallelAttention``. Without names
(``route_attention``, or ``cores=None``): every ``F.scaled_dot_product_attention`` call made
while the model runs goes to ring or Ulysses attention (``intercept``), which serves models
that call SDPA inline and Hugging Face models on their ``sdpa`` attention. Either way the
positions modules (``positions``) look up this rank's global positions. The weights are
untouched; everything else in the model works per token, which ``probe`` checks when
asked (``context_parallelize(..., probe=SequenceProbe(...))``). The ``Mode``
enum (ring or Ulysses) is defined in ``tessera.comm.sequence_modes`` (importable without torch).
"""

from __future__ import annotations

import logging

from torch import Tensor, nn

from tessera.comm import Group, group_size
from tessera.comm.sequence_modes import Mode
from tessera.tensor_parallel.context.intercept import AttentionRoute, route_modules
from tessera.tensor_parallel.context.layout import Layout
from tessera.tensor_parallel.context.positions import find_positions, follow_positions, guard_embeddings
from tessera.tensor_parallel.context.probe import SequenceProbe, probe_sequence_split
from tessera.tensor_parallel.context.ring import ring_attention
from tessera.tensor_parallel.context.ulysses import check_ulysses, ulysses_attention
from tessera.tensor_parallel.plan import match_pattern

__all__ = ["ContextParallelAttention", "Mode", "context_parallelize", "route_attention"]

_LOG = logging.getLogger(__name__)
_ROUTED = "_tessera_context_route"


class ContextParallelAttention(nn.Module):
    """An attention core over a sequence split across ``group``: ring or Ulysses attention."""

    def __init__(
        self,
        group: Group,
        *,
        mode: Mode | str = Mode.RING,
        layout: Layout | str = Layout.CONTIGUOUS,
        causal: bool = True,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.group, self.mode, self.layout = group, Mode(mode), Layout(layout)
        self.causal, self.scale = causal, scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        fn = ring_attention if self.mode is Mode.RING else ulysses_attention
        return fn(q, k, v, group=self.group, causal=self.causal, layout=self.layout, scale=self.scale)

    def extra_repr(self) -> str:
        return f"mode={self.mode.value}, layout={self.layout.value}, causal={self.causal}"


def _matching(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    found = [(n, m) for n, m in model.named_modules() if n and match_pattern(pattern, n)]
    if not found:
        raise ValueError(
            f"context_parallelize: pattern {pattern!r} matches no module of {type(model).__name__}"
        )
    return found


def _check_core(name: str, core: nn.Module, mode: Mode, cp: int, heads: int | None) -> None:
    if any(True for _ in core.parameters()):
        raise ValueError(f"attention core {name} has parameters; only a parameter-free core can be swapped")
    if float(getattr(core, "dropout", 0.0)) > 0:
        raise ValueError(
            f"attention core {name} has dropout {core.dropout}; context parallelism does not support it"
        )
    if mode is Mode.ULYSSES and heads is not None:
        check_ulysses(heads, heads, cp)


def context_parallelize(
    model: nn.Module,
    group: Group,
    *,
    mode: Mode | str = Mode.RING,
    layout: Layout | str = Layout.CONTIGUOUS,
    cores: str | None = "layers.*.attn.core",
    positions: str | None = "embed.pos",
    heads: int | None = None,
    probe: SequenceProbe | None = None,
) -> nn.Module:
    """Make ``model`` run on this rank's slice of the sequence (``layout``) over ``group``.

    Each module matching ``cores`` (plan-style dotted pattern) is replaced by a
    ``ContextParallelAttention`` with its ``causal`` flag (default True) and ``scale`` (if
    any); ``cores=None`` finds attention without names instead (``route_attention``). The
    modules matching ``positions`` (comma-separated patterns; None: none) follow the
    sequence shards (``positions.follow_positions``). ``heads``, when given, is checked
    against ``cp`` for Ulysses up front (the cores check the shapes they see anyway).
    Everything is checked before the model changes; returns the model. Feed it this rank's
    slice of each batch (``split_batch``), reduce the loss with ``context_parallel_loss``
    and sum the gradients over ``group`` (``sync_context_parallel_grads``).

    ``probe``: prove the split before returning (``probe.probe_sequence_split``): the model
    runs ``probe``'s token ids whole before it changes and this rank's slice after, and a
    forward that computes otherwise on a slice (positions or a mask from the local length)
    raises ValueError on every rank of ``group``, naming the first module that differs.
    """

    def install() -> nn.Module:
        if cores is None:
            return route_attention(model, group, mode=mode, layout=layout, positions=positions, heads=heads)
        return _swap_cores(model, group, mode, layout, cores=cores, positions=positions, heads=heads)

    return probe_sequence_split(model, group, install, probe=probe, layout=layout, positions=positions)


def _swap_cores(
    model: nn.Module,
    group: Group,
    mode: Mode | str,
    layout: Layout | str,
    *,
    cores: str,
    positions: str | None,
    heads: int | None,
) -> nn.Module:
    """``context_parallelize`` with the attention cores named (``cores``)."""
    mode, layout = Mode(mode), Layout(layout)
    cp = group_size(group)
    found = _matching(model, cores)
    for name, core in found:
        _check_core(name, core, mode, cp, heads)
    position_modules = _matching(model, positions) if positions is not None else []
    for name, core in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        wrapped = ContextParallelAttention(
            group,
            mode=mode,
            layout=layout,
            causal=bool(getattr(core, "causal", True)),
            scale=getattr(core, "scale", None),
        )
        setattr(parent, child, wrapped)
    follow_positions(position_modules, group, layout)
    return model


def _hf_sdpa(model: nn.Module) -> None:
    """Hugging Face models attend through ``config._attn_implementation``: ``sdpa`` calls
    SDPA (routed); ``eager`` (the same arithmetic) is switched to it; others are refused."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    for config in configs.values():
        impl = getattr(config, "_attn_implementation", "sdpa")
        if impl in (None, "eager"):
            config._attn_implementation = "sdpa"
            _LOG.info("context parallelism: %s attention switched from eager to sdpa", type(model).__name__)
        elif impl != "sdpa":
            raise ValueError(
                f"context parallelism routes SDPA attention; {type(model).__name__} uses "
                f"attn_implementation={impl!r}: load it with attn_implementation='sdpa'"
            )


def _routed_some(route: AttentionRoute) -> None:
    if route.calls == 0:
        raise ValueError(
            "context parallelism found no attention: the model's forward called no "
            "torch.nn.functional.scaled_dot_product_attention (an eager or custom attention "
            "cannot be split; call SDPA, or name parameter-free cores with cores=...)"
        )


def route_attention(
    model: nn.Module,
    group: Group,
    *,
    mode: Mode | str = Mode.RING,
    layout: Layout | str = Layout.CONTIGUOUS,
    positions: str | None = None,
    heads: int | None = None,
) -> nn.Module:
    """Make ``model`` context-parallel without naming its attention; returns it.

    Every ``F.scaled_dot_product_attention`` call during the model's forward (any module,
    any depth, also when recomputed by activation checkpointing) runs as ring or Ulysses
    attention (``mode``) over ``group`` on the sequence cut by ``layout`` (``intercept``);
    a forward that made no such call raises ValueError. The modules matching ``positions``
    (comma-separated patterns) and the autodetected ones (rotary modules, Hugging Face
    learned position embeddings) follow the sequence shards; an unhooked embedding called
    with ``arange`` raises (``positions``). ``heads`` is checked against ``cp`` for Ulysses
    up front. Hooks only: the modules and weights are unchanged. Training as for
    ``context_parallelize``.
    """
    mode, layout = Mode(mode), Layout(layout)
    if getattr(model, _ROUTED, None) is not None:
        raise ValueError(f"{type(model).__name__} is already context-parallel")
    if mode is Mode.ULYSSES and heads is not None:
        check_ulysses(heads, heads, group_size(group))
    position_modules = find_positions(model, positions)
    _hf_sdpa(model)
    route = AttentionRoute(group, mode.value, layout)
    follow_positions(position_modules, group, layout)
    guard_embeddings(model, position_modules)
    route_modules(model, route, check=_routed_some)
    setattr(model, _ROUTED, route)
    _LOG.info(
        "context parallelism (%s, %s) routes the SDPA of %s; positions: %s",
        mode.value, layout.value, type(model).__name__, [n for n, _ in position_modules] or "none",
    )  # fmt: skip
    return model
