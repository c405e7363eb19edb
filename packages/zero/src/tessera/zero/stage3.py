"""Stage 3's parameter life cycle: gather a unit's parameters just before use, free them after.

Forward: a unit's pre-hook makes sure its FlatParams are gathered (waiting for a prefetch
if one is in flight) and starts the all-gather of the unit expected next (the order the
previous forward ran in; the registration order the first time); its post-hook frees them
and hooks the unit's output tensors. Backward: the first gradient to reach a unit's output
means its backward is about to run, so that hook gathers the unit again and prefetches the
unit that ran before it in forward. The gradient reducer frees a unit's FlatParams once
their gradients are final; a frozen FlatParam (no gradient) is freed when backward reaches a
unit that ran before its own in forward, whose output gradient its unit's backward made.
The model itself is a unit too (it owns tied and otherwise unowned parameters); its
post-forward hook frees anything still gathered, and every gathered FlatParam is freed at
the end of backward.

``keep_for_backward`` (the default): a forward that records gradients keeps the model's own
FlatParams and the last unit's (the one expected last) gathered into backward, which needs
them first, as FSDP does for its root (``reshard_after_forward=False``). That saves their
backward all-gathers, which nothing could overlap, and does not raise the peak: backward
holds them at its start anyway. Between that forward and its backward they stay gathered.

With a ``BufferPool``, a freed unit's memory waits for the next gather of the same size
(``tessera.zero.pool``); the pool opens at the start of each forward and closes (releasing
its spares) when backward reaches the first unit of forward, or at the end of backward or
of a forward without gradients.

``prefetch_depth``: how many units ahead (in forward) or behind (in backward) are gathered
ahead of use; each one more holds one more unit gathered.

Moves each unit's padded parameters twice per step (forward and backward all-gathers), the
kept ones once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from tessera.zero.flat_param import FlatParam
from tessera.zero.grads import HookRunner
from tessera.zero.pool import BufferPool

__all__ = ["ParamGatherer"]


def _tensors(output: Any) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []


class ParamGatherer:
    """Hooks that gather and free each unit's FlatParams around its forward and backward."""

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[tuple[nn.Module, list[FlatParam]]],
        runner: HookRunner,
        *,
        prefetch: bool = True,
        prefetch_depth: int = 1,
        keep_for_backward: bool = True,
        pool: BufferPool | None = None,
    ) -> None:
        self.model = model
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        self.prefetch = prefetch
        self.depth = prefetch_depth
        self.keep_for_backward = keep_for_backward
        self.held = False  # every parameter stays gathered (a pipeline step); nothing is freed
        self._runner = runner
        self._pool = pool
        self._flats: dict[int, list[FlatParam]] = {id(m): fl for m, fl in units if fl}
        self._root_flats = self._flats.get(id(model), [])
        self._units = [m for m, fl in units if fl and m is not model]
        self._last_order: list[nn.Module] = []
        self._order: list[nn.Module] = []
        self._order_index: dict[int, int] = {}
        self._backward_seen: set[int] = set()
        self._frozen_from = 0  # backward has freed the frozen FlatParams of _order[_frozen_from:]
        self._handles = [
            model.register_forward_pre_hook(self._root_pre_forward),
            model.register_forward_hook(self._root_post_forward),
        ]
        for unit in self._units:
            self._handles.append(unit.register_forward_pre_hook(self._pre_forward))
            self._handles.append(unit.register_forward_hook(self._post_forward))

    # ------------------------------------------------------------------ helpers
    def all_flats(self) -> list[FlatParam]:
        """Every FlatParam this gatherer manages."""
        return [f for fl in self._flats.values() for f in fl]

    def _gather(self, module: nn.Module, *, for_backward: bool = False) -> None:
        for flat in self._flats.get(id(module), []):
            flat.wait_gathered()
            if for_backward:
                flat.prepare_grads()

    def _prefetch(self, modules: Sequence[nn.Module]) -> None:
        if not self.prefetch:
            return
        for module in modules:
            for flat in self._flats.get(id(module), []):
                flat.gather_async()

    def _free(self, module: nn.Module) -> None:
        if self.held:
            return
        for flat in self._flats.get(id(module), []):
            flat.free()

    def free_all(self) -> None:
        """Free every gathered FlatParam (the end of a forward without grad, or of backward)
        and release the spare memory kept for reuse: nothing stays until the next forward."""
        if self.held:
            return
        for flat in self.all_flats():
            flat.free()
        if self._pool is not None:
            self._pool.close()

    def _hook_backward(self, module: nn.Module, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(  # type: ignore[no-untyped-call]  # torch: Tensor.register_hook unannotated
                    lambda grad, m=module: self._runner.run(self._pre_backward, m)
                )

    # ------------------------------------------------------------------ forward
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self._order, self._order_index = [], {}
        self._backward_seen = set()
        self._frozen_from = 0
        if self._pool is not None:
            self._pool.open()
        for flat in self._root_flats:
            flat.wait_gathered()
        predicted = self._last_order or self._units
        self._prefetch(predicted[: self.depth])

    def _keeps(self, module: nn.Module) -> bool:
        """Whether ``module``'s FlatParams stay gathered from its forward into backward."""
        if not (self.keep_for_backward and torch.is_grad_enabled()):
            return False
        if module is self.model:
            return True
        predicted = self._last_order or self._units
        return bool(predicted) and predicted[-1] is module

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._last_order = list(self._order)
        if not self._keeps(module):
            self.free_all()
        elif not self.held:
            last = self._order[-1] if self._order else None
            for unit in self._units:
                if unit is not last:
                    self._free(unit)
        self._hook_backward(module, output)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self._gather(module)
        if id(module) not in self._order_index:
            self._order_index[id(module)] = len(self._order)
            self._order.append(module)
        predicted = self._last_order or self._units
        try:
            i = next(k for k, m in enumerate(predicted) if m is module)
        except StopIteration:
            return
        self._prefetch(predicted[i + 1 : i + 1 + self.depth])

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._keeps(module):
            self._free(module)
        self._hook_backward(module, output)

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, module: nn.Module) -> None:
        if id(module) in self._backward_seen:
            return
        self._backward_seen.add(id(module))
        if module is self.model:
            self._gather(module, for_backward=True)
            self._prefetch(self._order[::-1][: self.depth])
            return
        self._gather(module, for_backward=True)
        i = self._order_index.get(id(module))
        if i is not None:
            self._free_frozen_after(i)
            self._prefetch(self._order[max(0, i - self.depth) : i][::-1])
        if i == 0 and self._pool is not None:  # backward's last unit: no buffer will be taken again
            self._pool.close()

    def _free_frozen_after(self, i: int) -> None:
        """Free the frozen FlatParams of the units after ``_order[i]`` in forward: backward has
        reached ``_order[i]``'s output, so theirs is done, and no reduce will free them."""
        if self.held:
            return
        if self._frozen_from <= i:  # the first backward hook of this backward
            self._frozen_from = len(self._order)
        for unit in self._order[i + 1 : self._frozen_from]:
            for flat in self._flats.get(id(unit), []):
                if flat.frozen:
                    flat.free()
        self._frozen_from = min(self._frozen_from, i + 1)

    def remove(self) -> None:
        """Remove every hook."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
