"""Find a model's attention without names: its ``F.scaled_dot_product_attention`` calls.

While any module of a model made context-parallel by ``route_attention`` runs, a
``torch.overrides.TorchFunctionMode`` is active on that thread (modes are thread-local, so
other threads and code outside the model's forward see plain SDPA). It hands every
``scaled_dot_product_attention`` call to ring or Ulysses attention over the ``cp`` group and
passes every other torch function through unchanged. Every module's ``forward`` is wrapped
to enter it when none of the model's modules is running on this thread (a depth count) and
leave it when that forward returns or raises; so a layer recomputed by activation
checkpointing in backward, or run alone as a pipeline stage, is routed too. Inside the
mode's handler torch disables the mode, so the ring and Ulysses kernels (and anything they
call) reach the original function.

A routed call may be causal (``is_causal=True``, or an ``attn_mask`` that is exactly the
causal lower triangle of the local sequence, as Hugging Face builds it), causal within a
sliding window (called inside an attention module that has one, `attention_window`: its
mask is then the band of the window on the local sequence, and the ring skips the blocks
outside it), or full (no mask),
with K/V heads fewer than the query heads (GQA, with or without ``enable_gqa``) and any
``scale``; anything else (another mask, ``dropout_p > 0``, queries and keys of different
lengths) raises ValueError naming what was passed, before the call communicates.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from tessera.comm import Group, group_size
from tessera.tensor_parallel.context.layout import Layout
from tessera.tensor_parallel.context.ring import ring_attention
from tessera.tensor_parallel.context.ulysses import ulysses_attention

__all__ = ["AttentionRoute", "RoutingMode", "active_route", "attention_window", "causal_of", "route_modules"]

_LOG = logging.getLogger(__name__)
_SDPA: Callable[..., Tensor] = F.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclass(slots=True, eq=False)
class AttentionRoute:
    """Where a model's attention goes: ring or Ulysses (``mode``) over ``group``, the sequence
    cut by ``layout``; ``calls`` counts the calls routed (for the check that any were)."""

    group: Group
    mode: str
    layout: Layout
    calls: int = field(default=0)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float | None, window: int | None = None
    ) -> Tensor:
        """Ring or Ulysses attention of this rank's slice of the sequence (see their modules)."""
        self.calls += 1
        fn = ulysses_attention if self.mode == "ulysses" else ring_attention
        return fn(q, k, v, group=self.group, causal=causal, layout=self.layout, scale=scale, window=window)


_NO_WINDOW_SAID = -1  # a module that says nothing of a window (not an attention module)


def attention_window(module: nn.Module) -> int | None:
    """The sliding window of a Hugging Face attention module (``-1``: not one): its own
    ``sliding_window`` where it has the attribute (Qwen2, Gemma2/3: None on full-attention
    layers), else its config's (Mistral, Phi3, StarCoder2 read ``config.sliding_window``)."""
    if not type(module).__name__.endswith("Attention"):
        return _NO_WINDOW_SAID
    if hasattr(module, "sliding_window"):
        own = module.sliding_window
        return own if isinstance(own, int) and own > 0 else None
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window > 0 and getattr(config, "use_sliding_window", True):
        return window
    return None


def causal_of(mask: Tensor, q_len: int, k_len: int, window: int | None = None) -> bool | None:
    """True when ``mask`` (bool: True attends; float: 0 attends, very negative does not) is
    exactly the causal lower triangle on every broadcast slice (with ``window``: the band of
    it less than ``window`` below the diagonal, as a sliding window masks the local
    sequence), False when it allows every pair, None otherwise (a general mask: padding,
    documents, another window)."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) not in ((q_len, k_len), (1, k_len)):
        return None
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        blocked_ok = mask[~allowed] <= torch.finfo(mask.dtype).min / 2
        if not bool(blocked_ok.all()):
            return None
    else:
        return None
    if bool(allowed.all()):
        return False
    if q_len != k_len or mask.shape[-2] != q_len:
        return None
    tril = torch.ones(q_len, k_len, dtype=torch.bool, device=mask.device).tril()
    if window is not None:
        tril = tril.triu(-(window - 1))
    return True if bool((allowed == tril).all()) else None


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return repr(x)


def _route_call(route: AttentionRoute, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    """One intercepted SDPA call, checked and handed to ``route``."""
    extra = set(kwargs) - set(_SDPA_ARGS)
    if len(args) > len(_SDPA_ARGS) or extra:
        raise TypeError(f"scaled_dot_product_attention got unexpected arguments {sorted(extra)}")
    bound = dict(zip(_SDPA_ARGS, args, strict=False)) | kwargs
    q, k, v = bound["query"], bound["key"], bound["value"]
    mask, dropout = bound.get("attn_mask"), float(bound.get("dropout_p", 0.0))
    causal, scale = bool(bound.get("is_causal", False)), bound.get("scale")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            "context parallelism routes (batch, heads, seq, head_dim) attention; "
            f"scaled_dot_product_attention got query {tuple(q.shape)}, key {tuple(k.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"context parallelism needs self-attention over the local sequence: query length {q.shape[2]} "
            f"!= key length {k.shape[2]} (a KV cache or cross-attention is not supported)"
        )
    if dropout > 0:
        raise ValueError(
            f"context parallelism does not support attention dropout: dropout_p={dropout} "
            "(set it to 0, or pass it only in eval)"
        )
    window = _STATE.windows[-1] if _STATE.windows else None
    if mask is not None:
        as_causal = causal_of(mask, q.shape[2], k.shape[2], window) if isinstance(mask, Tensor) else None
        if as_causal is None or causal:
            said = f" within a sliding window of {window}" if window is not None else ""
            raise ValueError(
                f"context parallelism supports causal attention{said} (is_causal=True, or a mask that is "
                f"exactly causal) or no mask; scaled_dot_product_attention got attn_mask={_describe(mask)}, "
                f"is_causal={causal}"
            )
        causal = as_causal
    if window is not None and not causal:
        raise ValueError(f"a sliding window of {window} on attention that is not causal: not supported")
    return route.attend(q, k, v, causal=causal, scale=scale, window=window)


class RoutingMode(TorchFunctionMode):
    """Sends ``scaled_dot_product_attention`` to ``route``; every other function runs as is."""

    def __init__(self, route: AttentionRoute) -> None:
        super().__init__()
        self.route = route

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is _SDPA:
            return _route_call(self.route, args, kwargs or {})
        return func(*args, **(kwargs or {}))


@dataclass(slots=True)
class _Active:
    route: AttentionRoute
    mode: RoutingMode
    depth: int


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Active] = []
        self.windows: list[int | None] = []  # the sliding windows of the attention modules running


_STATE = _ThreadState()


def active_route() -> AttentionRoute | None:
    """The route of the context-parallel model running on this thread, if any."""
    return _STATE.stack[-1].route if _STATE.stack else None


def _enter(route: AttentionRoute) -> None:
    stack = _STATE.stack
    if stack and stack[-1].route is route:
        stack[-1].depth += 1
        return
    mode = RoutingMode(route)
    cast(Any, mode).__enter__()  # torch's TorchFunctionMode.__enter__ is untyped
    stack.append(_Active(route, mode, 1))


def _leave(route: AttentionRoute) -> None:
    stack = _STATE.stack
    if not stack or stack[-1].route is not route:
        return  # entered on another thread, or already unwound
    top = stack[-1]
    top.depth -= 1
    if top.depth == 0:
        stack.pop()
        cast(Any, top.mode).__exit__(None, None, None)


def route_modules(
    model: nn.Module, route: AttentionRoute, *, check: Callable[[AttentionRoute], None]
) -> None:
    """Wrap the ``forward`` of every module of ``model`` so that it runs with ``route`` active.

    The forward itself is wrapped (not hooked): activation checkpointing that replaces a
    layer's ``forward`` afterwards recomputes through the wrapper, so its SDPA calls are
    routed in backward too (checkpointing applied before routing recomputes the unwrapped
    forward of that layer: apply it after). ``check(route)`` runs after each outermost
    forward of ``model`` itself that did not raise (e.g. to refuse a model that routed
    nothing).
    """
    for module in model.modules():
        original = module.forward
        if "forward" in vars(module):
            _LOG.warning(
                "%s.forward was replaced before context parallelism; if that is activation "
                "checkpointing, apply it after, or its recomputed attention is not routed",
                type(module).__name__,
            )
        root = module is model
        window = attention_window(module)

        @functools.wraps(original)
        def forward(
            *args: Any,
            _original: Callable[..., Any] = original,
            _root: bool = root,
            _window: int | None = window,
            **kwargs: Any,
        ) -> Any:
            _enter(route)
            said = _window != _NO_WINDOW_SAID
            if said:
                _STATE.windows.append(_window)
            try:
                out = _original(*args, **kwargs)
            finally:
                if said:
                    _STATE.windows.pop()
                _leave(route)
            if _root and not (_STATE.stack and _STATE.stack[-1].route is route):
                check(route)
            return out

        module.forward = forward
    _LOG.debug(
        "attention of %s routed to %s over %d ranks",
        type(model).__name__, route.mode, group_size(route.group),
    )  # fmt: skip
