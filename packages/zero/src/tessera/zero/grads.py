"""Gradient reduction: reduce-scatter each FlatParam's gradients as soon as they are final.

Every parameter gets a post-accumulate-grad hook. When all parameters of a FlatParam have
their final gradient for this backward, its reduce-scatter starts asynchronously
(``reduce_scatter_async``), so communication overlaps the rest of backward. At most
``max_in_flight`` reductions are outstanding (each holds its output shard, and the backend
its input or, on gloo, a copy of it): launching one more first finishes the oldest.
``finish_backward`` launches what is left (parameters that got no gradient count as zeros)
and waits for all. Inside ``no_sync`` the hooks only count: gradients accumulate in
``param.grad`` and nothing is communicated. While ``held`` (a pipeline's step, whose many backwards run
in the schedule's order) the hooks do nothing at all, and the step reduces every FlatParam.

Stage 1 does not overlap: ``reduce_all`` reduces every FlatParam when the optimizer steps.
Stage 3 also frees a FlatParam's gathered parameters once its gradients are final.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from tessera.zero.flat_param import FlatParam

__all__ = ["GradReducer", "HookRunner"]


class HookRunner:
    """Runs hook bodies in the context of the thread that started backward, so the
    CommMeters open there see collectives started from autograd's device threads."""

    def __init__(self) -> None:
        self._ctx: contextvars.Context | None = None
        self._thread: int | None = None

    def begin(self) -> None:
        """Remember the calling thread and its context (call before ``backward``)."""
        self._ctx = contextvars.copy_context()
        self._thread = threading.get_ident()

    def run(self, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)``, inside the remembered context when on another thread."""
        if self._ctx is not None and threading.get_ident() != self._thread:
            self._ctx.run(fn, *args)
        else:
            fn(*args)


class GradReducer:
    """Tracks which FlatParams have final gradients and reduce-scatters them.

    ``overlap``: start each reduce-scatter from the hooks during backward (stages 2-3);
    ``on_final``: called with a FlatParam once all its gradients are final (stage 3 frees it);
    ``max_in_flight``: the most reduce-scatters outstanding at once.
    """

    def __init__(
        self,
        flats: Sequence[FlatParam],
        runner: HookRunner,
        *,
        overlap: bool,
        on_final: Callable[[FlatParam], None] | None = None,
        max_in_flight: int = 1,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.flats = list(flats)
        self.max_in_flight = max_in_flight
        self.overlap = overlap
        self.sync = True
        self.held = False  # accumulating: hooks neither count nor free; step() reduces everything
        self._runner = runner
        self._on_final = on_final
        self._pending: list[FlatParam] = []
        self._owner: dict[int, FlatParam] = {}
        self._handles: list[Any] = []
        spare: list[Tensor] = []  # the flat gradient buffers of stages 1-2, reused step to step
        largest = max((f.layout.padded_numel for f in self.flats), default=0)
        for flat in self.flats:
            for p in flat.params:
                self._owner[id(p)] = flat
            flat.spare_buffers, flat.spare_numel = spare, largest
        if overlap or on_final is not None:
            for flat in self.flats:
                for p in flat.params:
                    self._handles.append(
                        p.register_post_accumulate_grad_hook(self._hook)  # type: ignore[no-untyped-call]  # torch: hook API unannotated
                    )

    def _hook(self, param: Tensor) -> None:
        self._runner.run(self._on_grad, param)

    def _on_grad(self, param: Tensor) -> None:
        if self.held:
            return
        flat = self._owner[id(param)]
        flat.ready_params += 1
        if flat.ready_params != len(flat.params):
            return
        if self._on_final is not None:  # stage 3 frees the parameters before reducing
            self._on_final(flat)
        if self.overlap and self.sync:
            self._launch(flat)

    def _launch(self, flat: FlatParam) -> None:
        while self._pending and (len(self._pending) >= self.max_in_flight or self._pending[0].reduce_done()):
            self._pending.pop(0).finish_reduce()
        flat.start_reduce()
        flat.launched = True
        self._pending.append(flat)

    def wait_all(self) -> None:
        """Finish every reduce-scatter in flight."""
        for flat in self._pending:
            flat.finish_reduce()
        self._pending.clear()

    def finish_backward(self) -> None:
        """End of a backward: reduce what the hooks have not (when synchronising), wait for
        everything, call ``on_final`` for the FlatParams that got no final gradient, and reset
        (nothing while ``held``: the step reduces)."""
        if self.held:
            return
        for flat in self.flats:
            if self._on_final is not None and flat.ready_params != len(flat.params):
                self._on_final(flat)
            if self.overlap and self.sync and not flat.launched:
                self._launch(flat)
            flat.ready_params = 0
            flat.launched = False
        self.wait_all()

    def reduce_all(self) -> None:
        """Reduce-scatter every FlatParam's gradients now and wait (stage 1, at the step)."""
        for flat in self.flats:
            self._launch(flat)
            flat.launched = False
        self.wait_all()

    def in_flight(self) -> list[Tensor]:
        """The output shards of the reductions in flight."""
        return [b for f in self._pending if (b := f.reduce_output()) is not None]

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
