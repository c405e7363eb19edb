"""``bound_to_copy``: a function that reads a model, rebuilt to read the model's deep copy,
whichever way it holds the model (closure, bound method, partial, module-level name, a
helper that closes over it); the original function is left as it was."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import nn

from tessera.launcher.train.bound import bound_to_copy

GLOBAL_MODEL = nn.Linear(2, 2)


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def read(self) -> nn.Module:
        return self


def _copied(model: nn.Module) -> tuple[nn.Module, dict[int, Any]]:
    memo: dict[int, Any] = {}
    return copy.deepcopy(model, memo), memo


def test_a_closure_over_the_model_reads_the_copy() -> None:
    model = Holder()
    twin, memo = _copied(model)

    def loss() -> nn.Module:
        return model

    def inner() -> nn.Module:
        return model.inner

    assert bound_to_copy(loss, memo)() is twin
    assert bound_to_copy(inner, memo)() is twin.inner
    assert loss() is model  # the original is untouched


def test_a_submodule_a_method_and_a_partial_read_the_copy() -> None:
    model = Holder()
    twin, memo = _copied(model)
    sub = model.inner

    def of_sub() -> nn.Module:
        return sub

    assert bound_to_copy(of_sub, memo)() is twin.inner
    assert bound_to_copy(model.read, memo)() is twin

    def first(m: nn.Module, *, also: nn.Module) -> tuple[nn.Module, nn.Module]:
        return m, also

    got = bound_to_copy(functools.partial(first, model, also=sub), memo)()
    assert got[0] is twin and got[1] is twin.inner


def test_a_helper_that_closes_over_the_model_and_a_global_read_the_copy() -> None:
    model = Holder()
    twin, memo = _copied(model)

    def helper() -> nn.Module:
        return model

    def loss() -> tuple[nn.Module, nn.Module]:
        return helper(), GLOBAL_MODEL

    assert bound_to_copy(loss, memo)()[0] is twin
    _, memo2 = _copied(GLOBAL_MODEL)

    def reads_global() -> nn.Module:
        return GLOBAL_MODEL

    assert bound_to_copy(reads_global, memo2)() is memo2[id(GLOBAL_MODEL)]
    assert reads_global() is GLOBAL_MODEL


def test_a_function_that_reads_no_module_is_itself() -> None:
    _, memo = _copied(Holder())

    def plain(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert bound_to_copy(plain, memo) is plain
    assert bound_to_copy(torch.nn.functional.cross_entropy, memo) is torch.nn.functional.cross_entropy
