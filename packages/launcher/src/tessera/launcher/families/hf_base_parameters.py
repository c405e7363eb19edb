"""The parameters a Hugging Face base model holds itself (not in a module) and applies to the
hidden states before its layers, read from its forward: ZAYA's ``hidden_states =
((hidden_states + self.input_hidden_states_bias) * self.input_hidden_states_scale).to(torch.float32)``.

A pipeline stage holds modules; these parameters belong to none, so `BaseParameters` holds them
(the same ``nn.Parameter`` objects, under their own names) and applies the forward's statements to
the hidden states, in their order. ``hf.decoder_blocks``' first block holds it as a child, so the
first stage holds, trains and reduces them like any of its parameters, and their serial names are
the model's (placement finds a parameter by identity).

What is read: each statement of the forward before its loop over the layers that refers to one of
these parameters, which must be ``<hidden> = <expression>`` or ``<hidden> <op>= <expression>``,
``<hidden>`` the name the loop hands its layers as their hidden states, the expression built of
``<hidden>``, ``self.<such a parameter>``, ``torch.<name>``, constants, arithmetic and calls of
those (``.to(torch.float32)``). Any other such statement is a ValueError naming it, before anything
is partitioned; no source is executed: `BaseParameters` evaluates the read expressions node by
node. A parameter applied elsewhere (after the layers) is not read here: ``check_blocks`` finds
the blocks' logits off the model's. Importing this module does not import transformers.
"""

from __future__ import annotations

import ast
import inspect
import operator
import textwrap
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from tessera.launcher.families.hf_streams import layer_calls

__all__ = ["BaseParameters", "base_parameters"]

_OPERATORS: dict[type[ast.AST], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}  # fmt: skip
_UNARY: dict[type[ast.AST], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_NODES: tuple[type[ast.AST], ...] = (
    ast.Name, ast.Constant, ast.Attribute, ast.BinOp, ast.UnaryOp, ast.Call, ast.keyword, ast.Load,
    *_OPERATORS, *_UNARY,
)  # fmt: skip


def _evaluate(node: ast.AST, scope: dict[str, Any]) -> Any:
    """The value of an expression `_unread` accepts, its names taken from ``scope``."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return scope[node.id]
    if isinstance(node, ast.Attribute):
        return getattr(_evaluate(node.value, scope), node.attr)
    if isinstance(node, ast.BinOp):
        return _OPERATORS[type(node.op)](_evaluate(node.left, scope), _evaluate(node.right, scope))
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_evaluate(node.operand, scope))
    if isinstance(node, ast.Call):
        args = [_evaluate(a, scope) for a in node.args]
        kwargs = {k.arg: _evaluate(k.value, scope) for k in node.keywords if k.arg}
        return _evaluate(node.func, scope)(*args, **kwargs)
    raise ValueError(f"cannot evaluate {ast.unparse(node)}")  # `_unread` let it through: a defect


def _unread(value: ast.AST, hidden: str, own: set[str]) -> str | None:
    """The first part of ``value`` that is not read here (module docstring), or None."""
    for node in ast.walk(value):
        if not isinstance(node, _NODES) or (isinstance(node, ast.keyword) and node.arg is None):
            return ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__
        if isinstance(node, ast.Name) and node.id not in (hidden, "self", "torch"):
            return node.id
        is_self = (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        )
        if is_self and isinstance(node, ast.Attribute) and node.attr not in own:
            return f"self.{node.attr}"
    return None


class BaseParameters(nn.Module):
    """A base model's own parameters (``own``, by name) applied to the hidden states as its forward
    applies them before its layers: ``steps``, each an expression whose result becomes the hidden
    states (named ``hidden`` in it); see the module docstring."""

    def __init__(self, own: dict[str, nn.Parameter], hidden: str, steps: list[ast.expr]) -> None:
        super().__init__()
        for name, param in own.items():
            self.register_parameter(name, param)
        self.hidden, self.steps = hidden, steps

    def forward(self, h: Tensor) -> Tensor:
        for step in self.steps:
            h = _evaluate(step, {self.hidden: h, "self": self, "torch": torch})
        return h


def _statements(fn: Callable[..., Any], before: int) -> list[ast.Assign | ast.AugAssign]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return []
    found = [n for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.AugAssign) and n.lineno < before]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def base_parameters(base: nn.Module, stack: str) -> BaseParameters | None:
    """What ``base``'s forward applies of its own parameters before its layers ``self.<stack>``
    (module docstring), or None where it applies none; a ValueError naming a statement that
    applies them otherwise than read here."""
    own = dict(base.named_parameters(recurse=False))
    calls = layer_calls(type(base).forward, stack) if own else []
    if not calls:
        return None
    call = calls[0][0]
    first = (
        call.args[0]
        if call.args
        else next((k.value for k in call.keywords if k.arg == "hidden_states"), None)
    )
    hidden = first.id if isinstance(first, ast.Name) else ""
    steps: list[ast.expr] = []
    used: set[str] = set()
    for statement in _statements(type(base).forward, min(loop.lineno for _, _, loop in calls)):
        value = statement.value
        refers = {
            n.attr
            for n in ast.walk(value)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
        } & set(own)
        if not refers:
            continue
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        unread = _unread(value, hidden, set(own))
        if len(targets) != 1 or not isinstance(targets[0], ast.Name) or targets[0].id != hidden or unread:
            raise ValueError(
                f"{type(base).__name__} cannot be cut into pipeline stages: its forward applies its own "
                f"parameters {sorted(refers)} before its layers by `{ast.unparse(statement)}`, which the "
                f"blocks do not read ({unread or 'its target'}): only `{hidden or 'hidden_states'} = "
                "<an expression of it, the model's own parameters, torch and constants>`"
            )
        if isinstance(statement, ast.AugAssign):
            value = ast.BinOp(left=ast.Name(id=hidden, ctx=ast.Load()), op=statement.op, right=value)
        steps.append(value)
        used |= refers
    return BaseParameters({n: own[n] for n in own if n in used}, hidden, steps) if steps else None
