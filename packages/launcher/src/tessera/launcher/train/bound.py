"""A function that reads a model, turned into the same function reading the model's copy.

``verify=True`` trains a deep copy of the user's model serially with the user's loss
function. A loss that reads the model itself (an MoE model's auxiliary loss summed over its
layers, a regulariser over its weights) usually holds it through a closure, as a bound
method, in a ``functools.partial`` or as a module-level name; called as it is, it would
read the parallel model while the copy trains, and verify would report a difference that
is not there. `bound_to_copy` rebuilds such a function with every module that
``copy.deepcopy`` copied (found in the ``memo`` it filled) replaced by its copy: closure
cells, the bound ``self``, a partial's arguments, and the module-level names its code reads
(in a copy of its globals, so the original function is untouched), following nested
functions held the same ways. Anything else is kept as it is.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["bound_to_copy"]

_DEPTH = 4  # how deep nested helpers are followed (a helper of a helper of the loss, ...)


def _swap(value: Any, memo: dict[int, Any], depth: int) -> Any:
    if isinstance(value, nn.Module):
        return memo.get(id(value), value)
    held = inspect.isfunction(value) or inspect.ismethod(value) or isinstance(value, functools.partial)
    if depth > 0 and held:
        return _rebound(value, memo, depth - 1)
    return value


def _rebound(fn: Any, memo: dict[int, Any], depth: int) -> Any:
    if isinstance(fn, functools.partial):
        args = tuple(_swap(a, memo, depth) for a in fn.args)
        kwargs = {k: _swap(v, memo, depth) for k, v in fn.keywords.items()}
        func = _swap(fn.func, memo, depth)
        same = func is fn.func and all(a is b for a, b in zip(args, fn.args, strict=True))
        if same and all(kwargs[k] is v for k, v in fn.keywords.items()):
            return fn
        return functools.partial(func, *args, **kwargs)
    if inspect.ismethod(fn):
        owner, func = _swap(fn.__self__, memo, depth), _rebound(fn.__func__, memo, depth)
        return fn if owner is fn.__self__ and func is fn.__func__ else types.MethodType(func, owner)
    if not inspect.isfunction(fn):
        return _swap(fn, memo, depth)
    cells = fn.__closure__ or ()
    new_cells = tuple(_new_cell(cell, memo, depth) for cell in cells)
    scope = fn.__globals__
    names = [n for n in fn.__code__.co_names if n in scope]
    changed = {n: v for n in names if (v := _swap(scope[n], memo, depth)) is not scope[n]}
    if not changed and all(a is b for a, b in zip(new_cells, cells, strict=True)):
        return fn
    scope = {**scope, **changed} if changed else scope
    out = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, new_cells or None)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__ = fn.__qualname__
    return out


def _new_cell(cell: types.CellType, memo: dict[int, Any], depth: int) -> types.CellType:
    """``cell`` itself, or a new cell holding the copy of what it holds."""
    try:
        held = cell.cell_contents
    except ValueError:  # an empty cell (a name not bound yet)
        return cell
    swapped = _swap(held, memo, depth)
    return cell if swapped is held else types.CellType(swapped)


def bound_to_copy(fn: Callable[..., Any], memo: dict[int, Any]) -> Callable[..., Any]:
    """``fn`` reading, wherever it reads a module that ``copy.deepcopy(..., memo)`` copied, the
    copy instead (module docstring); ``fn`` itself when it reads none."""
    return _rebound(fn, memo, _DEPTH)  # type: ignore[no-any-return]
