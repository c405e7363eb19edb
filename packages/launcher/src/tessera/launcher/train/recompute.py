"""Activation memory per layer. Checkpointing (``train.activation_checkpointing``): a layer
of the model's layer stack keeps only its input for backward and runs its forward again
there; every layer, or every k-th (``train.recompute_every``), and either whole or keeping
its matrix products (``train.recompute_policy = "save-matmuls"``, torch's selective
checkpointing). Offload (``train.activation_offload``): a layer keeps what backward needs in
host memory.

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
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tessera.launcher.config.choices import RecomputePolicy
from tessera.tensor_parallel import ParallelDropout

__all__ = ["POLICIES", "checkpoint_layers", "offload_layers"]


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


class _Both:
    """Two context managers entered as one (the dropout replay and torch's selective policy)."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        self.second.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.second.__exit__(*exc)
        self.first.__exit__(*exc)


# ops whose outputs ``save-matmuls`` keeps: the products and attention, the costly part to redo
_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(generators: Sequence[torch.Generator], policy: str) -> tuple[Any, Any]:
    replay = _Replay(generators)
    if policy == "full":
        return replay.record, replay.replay
    forward, recompute = create_selective_checkpoint_contexts(_keep_matmuls)  # type: ignore[no-untyped-call]  # torch: unannotated
    return _Both(replay.record, forward), _Both(replay.replay, recompute)


POLICIES = tuple(RecomputePolicy)  # the names train.recompute_policy takes


def checkpoint_layers(layers: Sequence[nn.Module], *, every: int = 1, policy: str = "full") -> None:
    """Make every ``every``-th module of ``layers`` (the first, then each ``every`` after it)
    recompute its forward in backward, in place (the modules and their parameter names stay).
    ``policy``: "full" keeps only the layer's input; "save-matmuls" also keeps the outputs of
    its matrix products and attention and recomputes the rest (norms, activations)."""
    if every < 1 or policy not in POLICIES:
        raise ValueError(f"every={every} must be >= 1 and policy={policy!r} one of {', '.join(POLICIES)}")
    for layer in list(layers)[::every]:
        generators: list[torch.Generator] = []
        for module in layer.modules():
            if isinstance(module, ParallelDropout):
                generators += [g for g in module.rng.generators() if all(g is not h for h in generators)]
        original = layer.forward

        contexts = partial(_contexts, tuple(generators), policy)

        def forward(*args: Any, _original: Any = original, _contexts: Any = contexts, **kwargs: Any) -> Any:
            return checkpoint(_original, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

        layer.forward = forward


def offload_layers(layers: Sequence[nn.Module]) -> None:
    """Make every module of ``layers`` keep what its backward needs in host memory (pinned
    when an accelerator is present) instead of on the device, in place
    (``torch.autograd.graph.save_on_cpu``); composes with ``checkpoint_layers``."""
    pin = torch.cuda.is_available()
    for layer in layers:
        original = layer.forward

        def forward(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                return _original(*args, **kwargs)

        layer.forward = forward
