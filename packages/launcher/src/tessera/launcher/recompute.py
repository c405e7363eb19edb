"""Activation checkpointing per layer (``train.activation_checkpointing``): each layer of the
model's layer stack keeps only its input for backward and runs its forward again there.

Applied by ``boost()`` after tensor and context parallelism, so it wraps the parallel layers
as they run. The recomputed forward must draw the same dropout masks: torch's checkpoint
replays the device's default generator, and the tensor-parallel dropout streams
(``DropoutRNG``, explicit generators) are saved before each forward and replayed around its
recomputation here, then put back where the training run left them. ZeRO-3's hooks are on
the layers' ``__call__`` and the recomputation calls the original ``forward`` directly, so
parameters are gathered once for backward, as without checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tessera.tensor_parallel import ParallelDropout

__all__ = ["checkpoint_layers"]


class _Replay:
    """The context managers of one checkpointed call: ``record`` (around the forward) saves
    the streams' states; ``replay`` (around each recomputation: a split backward may recompute
    twice) runs from them and restores the states it found. Re-enterable, unlike generator
    context managers."""

    def __init__(self, generators: Sequence[torch.Generator]) -> None:
        self.generators = generators
        self.saved: list[torch.Tensor] = []
        self.found: list[list[torch.Tensor]] = []
        self.record, self.replay = _Enter(self._record), _Enter(self._replay, self._restore)

    def _record(self) -> None:
        self.saved = [g.get_state() for g in self.generators]

    def _replay(self) -> None:
        self.found.append([g.get_state() for g in self.generators])
        for g, state in zip(self.generators, self.saved, strict=True):
            g.set_state(state)

    def _restore(self) -> None:
        for g, state in zip(self.generators, self.found.pop(), strict=True):
            g.set_state(state)


class _Enter:
    def __init__(self, enter: Callable[[], None], leave: Callable[[], None] | None = None) -> None:
        self._enter, self._leave = enter, leave

    def __enter__(self) -> None:
        self._enter()

    def __exit__(self, *exc: object) -> None:
        if self._leave is not None:
            self._leave()


def _contexts(generators: Sequence[torch.Generator]) -> tuple[_Enter, _Enter]:
    replay = _Replay(generators)
    return replay.record, replay.replay


def checkpoint_layers(layers: Sequence[nn.Module]) -> None:
    """Make every module of ``layers`` recompute its forward in backward (in place: the
    modules and their parameter names stay)."""
    for layer in layers:
        generators: list[torch.Generator] = []
        for module in layer.modules():
            if isinstance(module, ParallelDropout):
                generators += [g for g in module.rng.generators() if all(g is not h for h in generators)]
        original = layer.forward

        contexts = partial(_contexts, tuple(generators))

        def forward(*args: Any, _original: Any = original, _contexts: Any = contexts, **kwargs: Any) -> Any:
            return checkpoint(_original, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

        layer.forward = forward
