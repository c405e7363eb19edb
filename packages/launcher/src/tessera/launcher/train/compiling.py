"""torch.compile per block (``train.compile``, ``boost(..., compile=True)``), as torchtitan does.

``boost()`` compiles each layer of the model's layer stack (the layers activation
checkpointing wraps) on its own, after tensor and context parallelism have replaced its
modules and the pipeline cut has chosen this rank's layers. Each layer's ``forward`` is
compiled, not its ``__call__``, so the hooks on the layer (ZeRO-3 gathers and frees its
parameters there) stay eager, and the modules and their parameter names stay as they are
(no ``_orig_mod`` wrapper). Activation checkpointing and offload then wrap the compiled
forward (torchtitan compiles around its checkpointing instead): the checkpoint replays the
tensor-parallel dropout streams around its recomputation through a ``context_fn`` of plain
context managers, which torch's compiled checkpoint does not take, so it stays eager and
calls the compiled forward twice, once in forward and once to recompute.

Collectives are not traced: ``tessera.comm`` marks its collectives, point-to-point
transfers, handles' waits and the autograd Functions around them (every package enters
them through ``comm.ops.apply_function``) ``never_compiled`` (``tessera.comm.eager``), so a
compiled layer breaks its graph at each and they run eagerly, forward and backward, as they
do uncompiled; what lies between them is compiled. Graphs are therefore partial
(``fullgraph=False``). The layers of a stack share one class and so their compiled code
(dynamo guards on shapes, not on which layer it runs).

Random numbers (dropout) are drawn by torch's own kernels, as eagerly (inductor's
``fallback_random``), not by inductor's generator: a compiled layer draws the masks its
eager twin draws from the same generator state, so the tensor-parallel dropout streams and
checkpointing's replay keep their meaning and a compiled run still equals the serial one
(inductor's own generator draws other masks).

Refused (`compile_problems`, part of the config's validation): a pipeline schedule that
splits the backward (input and weight gradients apart: zb-h1, zbv). A compiled layer's
backward is one node that computes both, and the split runs it with ``retain_graph``, which
the compiled backward refuses (its buffers are donated); run those schedules eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tessera.launcher.config.compile_rules import compile_problems

__all__ = ["compile_layers", "compile_problems"]

log = logging.getLogger(__name__)


def compile_layers(layers: Sequence[nn.Module], *, backend: str = "inductor") -> int:
    """Compile the ``forward`` of each module of ``layers`` with ``torch.compile`` on its own,
    in place (compiled on first call; the modules, their hooks and parameter names stay);
    returns how many were compiled."""
    eager_random: dict[str, str | int | bool | Callable[..., Any]] = {"fallback_random": True}
    options = eager_random if backend == "inductor" else None  # inductor's option only
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, options=options)
    log.info("torch.compile (%s): %d layers, each on its own", backend, len(layers))
    return len(layers)
