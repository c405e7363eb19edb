"""What a Hugging Face model's decoder layers carry between them besides one hidden state, read
from the model's config and forward, and how a pipeline stage's one activation holds it.

- Residual streams (hyper-connections): the embedding's output copied into several streams,
  side by side (``config.hc_count``, Qwen4-Exp: ``[batch, seq, n * hidden]``) or stacked
  (``config.hc_mult``, DeepSeek-V4, GLM5-Next, HunYuan-V4: ``[batch, seq, n, hidden]``); a
  module after the layers mixes them back into one. They are the hidden state: one tensor.
- Values a layer returns beside its hidden states that the model hands to the next layer
  (HunYuan-V4's top-k indices: ``hidden_states, topk_indices = decoder_layer(...,
  prev_topk_indices=topk_indices)``; ZAYA's router state, by position: ``hidden_states,
  prev_router_hidden_states = decoder_layer(hidden_states, prev_router_hidden_states, ...)``),
  read from the forward's loop over its layers (plain or ``enumerate``; `layer_calls`,
  `carried_between_layers`). A pipeline stage sends one floating-point tensor, so `pack`
  appends those of another dtype as bytes (viewed as the activation's dtype, no arithmetic:
  exact for any dtype) and a small int64 header after the hidden states, and `unpack` takes
  them apart on the next stage; their slots get no gradient (integer indices are not
  differentiated; one of another dtype that requires a gradient is refused naming it, not
  dropped: ZAYA's router state in a bf16 model, beside its fp32 residual stream). A
  value that is not a tensor laid out by token (``[batch, seq, ...]``) cannot be carried and is
  refused naming it (`pack`), which `check_blocks` reports before anything is partitioned.
- Values the forward keeps beside the hidden states and hands every layer as a further
  argument, updated from themselves in the loop (not one the layer before returned), appending
  a layer's input to them where an attribute of the layer says so (`kept_between_layers`:
  Inkling 2's block states, ``[batch, seq, blocks, hidden]``, grown on ``is_block_boundary``); a
  rule not read is refused. They start as an empty stack (`empty_stack`), grow by `stacked_on`,
  and travel as values after the hidden states (their dtype), with their gradient: a later layer
  attends over them.
- The modules a model applies after its layers, in the order its forward applies them
  (`applied_order`: HunYuan-V4's ``self.norm(self.hc_head(h))``, whose ``base_model_pp_plan``
  names the norm alone), given what they name of the carried values (`apply_after`: Inkling 2's
  ``final_input(block_states, hidden_states)[0]``).
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "Streams",
    "applied_order",
    "apply_after",
    "carried_between_layers",
    "empty_stack",
    "kept_between_layers",
    "layer_calls",
    "pack",
    "stacked_on",
    "streams_of",
    "unpack",
]


@dataclass(frozen=True, slots=True)
class Streams:
    """``count`` residual streams, stacked on a new dimension 2 or side by side in the last."""

    count: int
    stacked: bool

    def __call__(self, h: Tensor) -> Tensor:
        if self.stacked:  # inputs_embeds.unsqueeze(2).expand(-1, -1, hc_mult, -1).contiguous()
            return h.unsqueeze(2).expand(-1, -1, self.count, -1).contiguous()
        return h.repeat(1, 1, self.count)


def streams_of(config: Any) -> Streams | None:
    """The residual streams the layers of a model of ``config`` take, or None (one hidden state)."""
    stacked, side_by_side = getattr(config, "hc_mult", None), getattr(config, "hc_count", None)
    if stacked:
        return Streams(int(stacked), True)
    return Streams(int(side_by_side), False) if side_by_side else None


def _forward_tree(fn: Callable[..., Any]) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None


def _self_attribute(node: ast.AST) -> str | None:
    is_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    return node.attr if is_self and isinstance(node, ast.Attribute) else None


def applied_order(fn: Callable[..., Any]) -> list[str]:
    """The ``self.<name>`` a forward refers to, in the order it applies them: a call once its
    arguments are computed (``self.norm(self.hc_head(h))``: ``hc_head``, then ``norm``), any other
    reference (the loop over ``self.layers``) where it stands; [] when its source is not readable."""
    tree = _forward_tree(fn)
    order: list[str] = []

    def visit(node: ast.AST) -> None:
        called = _self_attribute(node.func) if isinstance(node, ast.Call) else None
        if isinstance(node, ast.Call) and called is not None:
            for child in [*node.args, *node.keywords]:
                visit(child)
            order.append(called)
            return
        name = _self_attribute(node)
        if name is not None:
            order.append(name)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    if tree is not None:
        visit(tree)
    return order


def _loops_over(tree: ast.AST | None, stack: str) -> list[tuple[ast.For, str]]:
    """The forward's loops over ``self.<stack>`` (or a slice of it, or ``enumerate`` of either:
    ZAYA's ``for idx, decoder_layer in enumerate(self.layers)``), with the loop's layer name."""
    found = []
    for loop in (n for n in ast.walk(tree) if isinstance(n, ast.For)) if tree is not None else ():
        over, target = loop.iter, loop.target
        counted = (
            isinstance(over, ast.Call) and isinstance(over.func, ast.Name) and over.func.id == "enumerate"
        )
        if counted and isinstance(over, ast.Call) and over.args and isinstance(target, ast.Tuple):
            over, target = over.args[0], target.elts[-1]
        over = over.value if isinstance(over, ast.Subscript) else over
        if _self_attribute(over) == stack and isinstance(target, ast.Name):
            found.append((loop, target.id))
    return found


def layer_calls(fn: Callable[..., Any], stack: str) -> list[tuple[ast.Call, list[str], ast.For]]:
    """The forward ``fn``'s calls of a layer of ``self.<stack>`` inside its loops over them, each
    with the names its result is unpacked into (``hidden_states, topk_indices = decoder_layer(...)``:
    both; [] where it is not unpacked) and the loop; [] when the source is not readable."""
    found: list[tuple[ast.Call, list[str], ast.For]] = []
    for loop, layer in _loops_over(_forward_tree(fn), stack):
        unpacked: dict[int, list[str]] = {}
        for node in (n for n in ast.walk(loop) if isinstance(n, ast.Assign)):
            target = node.targets[0]
            if isinstance(target, ast.Tuple):
                unpacked[id(node.value)] = [e.id if isinstance(e, ast.Name) else "" for e in target.elts]
        for call in (n for n in ast.walk(loop) if isinstance(n, ast.Call)):
            if isinstance(call.func, ast.Name) and call.func.id == layer:
                found.append((call, unpacked.get(id(call), []), loop))
    return found


def carried_between_layers(fn: Callable[..., Any], stack: str, params: Sequence[str] = ()) -> dict[str, int]:
    """What the forward ``fn`` hands each layer of ``self.<stack>`` from the layer before: the
    layer's parameter it fills, and where in the layer's returned tuple it comes from; passed by
    keyword (HunYuan-V4's ``{"prev_topk_indices": 1}``) or by position, named by the layer's
    parameters ``params`` in order (ZAYA's ``decoder_layer(hidden_states, prev_router_hidden_states,
    ...)``: ``{"prev_router_hidden_states": 1}``); {} when nothing is, or the source is not readable.
    A value passed by a position ``params`` does not name is a ValueError naming it."""
    carried: dict[str, int] = {}
    for call, names, _ in layer_calls(fn, stack):
        passed = [(k.arg, k.value) for k in call.keywords if k.arg]
        for at, value in enumerate(call.args[1:], start=1):
            if at >= len(params) and isinstance(value, ast.Name) and value.id in names[1:]:
                raise ValueError(
                    f"the forward hands its layers {value.id!r} (their output {names.index(value.id)}) as "
                    f"argument {at}, beyond their parameters {list(params)}"
                )
            passed += [(params[at], value)] if at < len(params) else []
        for name, value in passed:
            if isinstance(value, ast.Name) and value.id in names[1:]:
                carried[name] = names.index(value.id)
    return carried


def _accumulated(loop: ast.For) -> set[str]:
    """The names the loop assigns from themselves (``block_states = torch.cat([block_states, ...])``):
    what it keeps from layer to layer; a name it hands every layer unchanged (a mask, the embeddings'
    output) or makes afresh for each (Gemma 4's ``per_layer_input = per_layer_inputs[:, :, i]``) is not."""
    found: set[str] = set()
    for node in (n for n in ast.walk(loop) if isinstance(n, ast.Assign | ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        read = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
        if isinstance(node, ast.AugAssign):
            read |= {t.id for t in targets if isinstance(t, ast.Name)}
        found |= {t.id for t in targets if isinstance(t, ast.Name) and t.id in read}
    return found


def kept_between_layers(fn: Callable[..., Any], stack: str) -> dict[str, str | None]:
    """What the forward ``fn`` keeps beside the hidden states and hands each layer of ``self.<stack>``
    as a further positional argument, updating it from itself in the loop (`_accumulated`), with the
    layer attribute under which it appends the layer's input to it (Inkling 2's ``{"block_states":
    "is_block_boundary"}``: ``if decoder_layer.is_block_boundary: block_states =
    torch.cat([block_states, hidden_states...])``); None where no such rule is read (the blocks
    then refuse it)."""
    kept: dict[str, str | None] = {}
    for call, _, loop in layer_calls(fn, stack):  # what a layer returns (unpacked, carried) is not kept
        given = {a.id for a in call.args[1:] if isinstance(a, ast.Name)}
        kept.update(dict.fromkeys(sorted(given & _accumulated(loop)), None))
    for loop, layer in _loops_over(_forward_tree(fn), stack):
        for branch in (n for n in ast.walk(loop) if isinstance(n, ast.If)):
            test = branch.test  # `if <layer>.<attribute>:`
            if not isinstance(test, ast.Attribute) or not isinstance(test.value, ast.Name):
                continue
            if test.value.id != layer:
                continue
            for statement in (n for n in branch.body if isinstance(n, ast.Assign)):
                for target in (t for t in statement.targets if isinstance(t, ast.Name) and t.id in kept):
                    kept[target.id] = test.attr
    return kept


def stacked_on(state: Tensor, h: Tensor) -> Tensor:
    """``state`` with ``h`` appended as its last entry (``torch.cat([state, h.unsqueeze(-2)], -2)``)."""
    return torch.cat([state, h.unsqueeze(-2)], dim=-2)


def empty_stack(h: Tensor) -> Tensor:
    """A stack of no entries like ``h`` (``h.new_zeros(*h.shape[:-1], 0, h.shape[-1])``)."""
    return h.new_zeros(*h.shape[:-1], 0, h.shape[-1])


def apply_after(module: Any, h: Tensor, carried: dict[str, Tensor | None]) -> Tensor:
    """``module`` applied to ``h`` as the forward applies it after the layers: given the carried
    values its forward names (Inkling 2's ``final_input(block_states, hidden_states)[0]``)."""
    params = list(inspect.signature(module.forward).parameters)
    given = {n: carried[n] for n in params if n in carried}
    if not given:
        out = module(h)
    else:
        rest = [n for n in params if n not in given]
        out = module(**given, **{rest[0]: h})
    return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


# the dtypes a carried value may have, by their code in the header
_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)  # fmt: skip


def _bytes_of(name: str, value: Tensor, hidden: Tensor) -> Tensor:
    lead = tuple(hidden.shape[:2])
    if tuple(value.shape[:2]) != lead or value.dtype not in _DTYPES:
        raise ValueError(
            f"{name} ({value.dtype}, shape {tuple(value.shape)}) cannot be carried to the next pipeline "
            f"stage: only a tensor laid out by token like the hidden states {list(lead)} can"
        )
    if value.requires_grad:  # as bytes it would cross without its gradient: refused, not dropped
        raise ValueError(
            f"{name} ({value.dtype}) cannot be carried to the next pipeline stage with its gradient: "
            f"only a value in the hidden states' dtype ({hidden.dtype}) can"
        )
    return value.detach().reshape(*lead, -1).contiguous().view(torch.uint8)


_ABSENT, _VALUES = -1, -2  # header codes: nothing carried; carried as values (the activation's dtype)


def pack(hidden: Tensor, carried: Sequence[tuple[str, Any]]) -> Tensor:
    """One activation holding ``hidden`` and the carried values (by name, None where absent): those
    of the hidden states' dtype as values after them (differentiable: Inkling 2's block states),
    the others as bytes after those (no gradient: HunYuan-V4's top-k indices), and a header
    saying how to take them apart (`unpack`)."""
    lead, width = tuple(hidden.shape[:2]), hidden.element_size()
    header: list[int] = [len(carried)]
    values: list[Tensor] = [hidden.reshape(*lead, -1)]
    parts: list[Tensor] = []
    for name, value in carried:
        if value is None:
            header.append(_ABSENT)
            continue
        if not isinstance(value, Tensor):
            raise ValueError(
                f"{name} ({type(value).__name__}) cannot be carried to the next pipeline stage: "
                "a stage sends and receives tensors only"
            )
        shape = [value.dim() - 2, *value.shape[2:]]
        if value.dtype == hidden.dtype and tuple(value.shape[:2]) == lead:
            values.append(value.reshape(*lead, -1))
            header += [_VALUES, *shape]
        else:
            parts.append(_bytes_of(name, value, hidden))
            header += [_DTYPES.index(value.dtype), *shape, parts[-1].shape[-1]]
    header += [hidden.dim() - 2, *hidden.shape[2:]]
    header.append(len(header))
    meta = torch.tensor(header, dtype=torch.int64, device=hidden.device).view(torch.uint8)
    size = sum(p.shape[-1] for p in parts) + meta.numel()
    pad = hidden.new_zeros((*lead, -size % width), dtype=torch.uint8)
    tail = torch.cat([pad, *parts, meta.expand(*lead, -1)], dim=-1).view(hidden.dtype)
    return torch.cat([*values, tail], dim=-1)


_Spec = tuple[int, list[int], int]  # (code: _VALUES or a dtype's, dimensions after [batch, seq], bytes)


def _read(header: list[int]) -> tuple[list[_Spec | None], list[int]]:
    """Each carried value's `_Spec`, None where absent, and the hidden states' dimensions after
    ``[batch, seq]``, from `pack`'s header."""
    specs: list[_Spec | None] = []
    at = 1
    for _ in range(header[0]):
        code = header[at]
        if code == _ABSENT:
            specs.append(None)
            at += 1
            continue
        ndim = header[at + 1]
        dims, at = header[at + 2 : at + 2 + ndim], at + 2 + ndim
        specs.append((code, dims, 0 if code == _VALUES else header[at]))
        at += 0 if code == _VALUES else 1
    return specs, header[at + 1 : at + 1 + header[at]]


def _fresh(t: Tensor) -> Tensor:
    """A contiguous copy at the start of its own storage (a dtype view needs an aligned offset)."""
    return t.clone(memory_format=torch.contiguous_format)


def _shaped(flat: Tensor, dims: list[int]) -> Tensor:
    return flat.reshape(*flat.shape[:-1], *dims) if dims else flat[..., 0]


def unpack(packed: Tensor) -> tuple[Tensor, list[Tensor | None]]:
    """The hidden states and the carried values `pack` put in ``packed`` (those carried as values
    differentiable, as slices of it)."""
    raw = _fresh(packed.detach()[0, 0]).view(torch.uint8)
    length = int(_fresh(raw[-8:]).view(torch.int64))
    header = [int(v) for v in _fresh(raw[-8 * (length + 1) : -8]).view(torch.int64)]
    specs, dims = _read(header)
    lead, start = tuple(packed.shape[:2]), math.prod(dims)
    hidden = _shaped(packed[..., :start], dims)
    values: list[Tensor | None] = [None] * len(specs)
    for i, spec in enumerate(specs):
        if spec is not None and spec[0] == _VALUES:
            size = math.prod(spec[1])
            values[i] = _shaped(packed[..., start : start + size], spec[1])
            start += size
    tail = _fresh(packed.detach()[..., start:]).view(torch.uint8)
    stop = tail.shape[-1] - 8 * (length + 1)
    for i, spec in reversed(list(enumerate(specs))):  # bytes laid out before the header: read back
        if spec is None or spec[0] == _VALUES:
            continue
        code, shape, width = spec
        values[i] = _fresh(tail[..., stop - width : stop]).view(_DTYPES[code]).reshape(*lead, *shape)
        stop -= width
    return hidden, values
