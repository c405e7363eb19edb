"""What torch.compile must not trace: ``never_compiled`` marks a function that runs eagerly
when compiled code calls it (a graph break there, the function and all it calls as written).

Collectives live here: process groups, shared memory, lane threads and locks, and the
autograd Functions around them (`tessera.comm.ops.apply_function`, the entry every package
uses) are marked, so a compiled model breaks its graph at each collective and compiles
what lies between (``tessera.launcher.train.compiling``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["never_compiled"]

Fn = TypeVar("Fn", bound=Callable[..., Any])


def never_compiled(fn: Fn) -> Fn:
    """``fn``, run eagerly (never traced) when torch.compile'd code calls it."""
    return cast(Fn, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]  # torch: disable is unannotated
