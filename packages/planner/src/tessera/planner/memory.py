"""Bytes one rank holds: model state per ZeRO stage, precision and offload, activations per
tensor-parallel mode, sequence and context parallelism, pipeline schedule and recomputation.

Model state counts what ``ZeroOptimizer.memory()`` counts after a backward, for a rank
holding ``psi`` parameter elements (its tensor- and pipeline-parallel share), sharded over
the ``n`` ranks of its ZeRO group (dp x cp), compute dtype of ``c`` bytes:

- parameters: ``c psi`` (stage 3: ``c psi / n``, the full buffers freed between uses);
- gradients: ``c psi`` in stages 0-1, plus a shard: ``c psi / n`` in stages 2-3, or with
  offload the fp32 host shard ``4 psi / n`` instead;
- fp32 masters ``4 psi / n``: a separate copy only with mixed precision or offload (in fp32
  the shard is the master);
- optimizer state ``K psi / n`` (Adam: K = 8, SGD with momentum 4, plain SGD 0), plus 4 bytes
  of Adam's step counter per flat buffer.

Stage 0 is plain data parallelism: nothing is sharded (n = 1 in every term). Under a
pipeline or Megatron sequence parallelism the engine reduces once per step
(``accumulating()``): stages 2-3 then hold full parameters and gradients until the step. With offload,
masters, their gradients and optimizer state live on the host and do not count against the
device. Flat buffers pad each shard to 16 bytes (below ``n * 16`` bytes per buffer: ignored).

Activations per layer and microbatch follow Korthikanti et al. (2022) for this GPT's layer,
in the compute dtype: ``s b h (8 + 2 r)`` elements saved for backward (r: mlp ratio; 16 at
r = 4) plus ``a s^2 b`` attention probabilities unless attention is fused (flash: none), and
dropout masks (1 byte each) when dropout is on. 1D tensor parallelism splits the part inside
the attention and MLP regions ``tp`` ways and keeps the 4 layer inputs whole, Megatron
sequence parallelism splits those too; 2D, 2.5D and 3D split every activation ``tp`` ways
(batch and hidden blocks); context parallelism splits the sequence ``cp`` ways. Full
recomputation keeps only each layer's input. A pipeline rank holds as many microbatch x
chunk units as the simulator's ``peak_held`` says; without a pipeline, one microbatch.
(3D tensor parallelism keeps more: ``tessera.planner.transient.activations_3d`` replaces the split.)

What a rank holds besides, at the other moments of a step (end of backward, optimizer step,
building the engine), is ``tessera.planner.transient``'s; `MemoryEstimate` puts the two together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.comm.shm_sizes import LINE_BYTES
from tessera.planner.model import ModelShape, TPShape
from tessera.zero.precisions import ELEMENT_BYTES

__all__ = ["ActivationShape", "MemoryEstimate", "activation_bytes", "model_state_bytes", "optimizer_bytes"]

OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 4}  # fp32 state per parameter (SGD: momentum)
DTYPE_BYTES: dict[str, int] = {p.value: n for p, n in ELEMENT_BYTES.items()}  # by precision name


def optimizer_bytes(name: str, momentum: float = 0.9) -> int:
    """Optimizer-state bytes per parameter element (fp32)."""
    if name == "sgd":
        return 4 if momentum > 0 else 0
    return OPTIMIZER_BYTES[name]


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Predicted bytes per rank: model state (by kind, and how much of it sits on the host),
    activations at the peak, and transient communication buffers."""

    parameters: float
    gradients: float
    optimizer_state: float
    host: float
    activations: float
    buffers: float
    scratch: float = 0.0  # transient once the activations are freed (`tessera.planner.transient`)
    build: float = 0.0  # resident while boost() builds the engine (host, before training)
    shared: float = 0.0  # the groups' shared-memory segments (host, CPU clusters)

    @property
    def model_state(self) -> float:
        """Parameters + gradients + optimizer state (masters included), wherever they live."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def device(self) -> float:
        """What must fit in the device's memory: model state on the device plus the larger of
        the activations with their buffers (forward, early backward) and the scratch of the
        end of the backward and of the optimizer step."""
        return self.model_state - self.host + max(self.activations + self.buffers, self.scratch)

    @property
    def resident(self) -> float:
        """The process's peak where host and device are one memory (a CPU run): the device's
        bytes plus the host's share and the shared-memory segments, or the build, whichever
        is more."""
        return max(self.device + self.host + self.shared, self.build)


def model_state_bytes(
    psi: float,
    *,
    stage: int,
    n: int,
    precision: str,
    offload: bool,
    optimizer: str = "adamw",
    flats: int = 1,
    one_reduction: bool = False,
) -> tuple[float, float, float, float]:
    """(parameters, gradients, optimizer state with masters, of which on the host) in bytes
    for a rank holding ``psi`` elements sharded over ``n`` ranks at ZeRO ``stage``, at the
    peak of a step. ``one_reduction``: the engine runs the step's backwards inside
    ``ZeroOptimizer.accumulating()`` (a pipeline, or Megatron sequence parallelism), where
    stages 2-3 hold full parameters and full gradients until the step (stage 3 also its
    parameter shard)."""
    c = DTYPE_BYTES[precision]
    n = 1 if stage == 0 else n
    k = optimizer_bytes(optimizer)
    master = 4 if (c != 4 or offload) else 0
    params = c * psi if stage < 3 else c * psi / n
    shard_grads = 4 * psi / n if offload else (c * psi / n if stage >= 2 else 0.0)
    grads = (c * psi if stage <= 1 else 0.0) + shard_grads
    if one_reduction and stage >= 2:
        params = c * psi + (c * psi / n if stage == 3 else 0.0)
        grads = c * psi + (4 * psi / n if offload else 0.0)
    state = (master + k) * psi / n + (4 * flats if k == 8 else 0)
    host = (master + k + 4) * psi / n if offload else 0.0
    return params, grads, state, host


@dataclass(frozen=True, slots=True)
class ActivationShape:
    """How one rank's activations are split: tensor parallelism, Megatron sequence
    parallelism, context parallelism, recomputation."""

    tp: TPShape = field(default_factory=TPShape)
    sequence_parallel: bool = False
    cp: int = 1
    recompute: bool = False


def activation_bytes(
    model: ModelShape, rows: float, precision: str, shape: ActivationShape, *, layers: int | None = None
) -> list[float]:
    """Bytes each block ``[embed, *layers, head]`` keeps for backward for one microbatch of
    ``rows`` sequences on one rank (``layers``: list that many layers, default all)."""
    c = DTYPE_BYTES[precision]
    t = shape.tp.tp
    s = model.seq / shape.cp
    sbh = s * rows * model.hidden
    masks = 1.0 if model.dropout else 0.0
    scores = 0.0 if model.flash_attention else model.heads * s * model.seq * rows * (c + masks)
    inside = sbh * (4 + 2 * model.mlp_ratio) * c + scores  # between the column and row layers
    whole = sbh * (4 * c + 2 * masks)  # the layer's inputs, residual-stream masks
    split_all = shape.tp.mode != "1d" or shape.sequence_parallel
    layer = (inside + whole) / t if split_all else inside / t + whole
    if shape.recompute:
        layer = sbh * c / (t if shape.sequence_parallel or shape.tp.mode != "1d" else 1)
    logits = s * rows * model.vocab * (c + 4) / t  # logits and the fp32 softmax of the loss
    split_stream = t if shape.sequence_parallel or shape.tp.mode != "1d" else 1
    embed = sbh * (c + masks) / split_stream
    head = 2 * sbh * c / split_stream + logits
    return [embed, *([layer] * (model.layers if layers is None else layers)), head]


def shm_segment_bytes(n: int, message: float, slots: float) -> float:
    """Resident bytes on one rank of a group's shared-memory segment (`tessera.comm.shm`,
    ``slots`` bytes of slots; 0 where collectives do not use one): its counters and, of its
    ``2 n`` slots (two parities, every rank's, all of them read), the pages the group's
    largest per-rank message touches. Every rank maps the whole segment, so each counts
    these pages, though the host holds them once."""
    if n < 2 or slots <= 0:
        return 0.0
    return 2 * n * LINE_BYTES + 2 * n * min(slots / (2 * n), message)
