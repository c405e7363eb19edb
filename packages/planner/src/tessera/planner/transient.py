"""Bytes a rank holds besides model state and saved activations, at the three moments where
its resident set peaks: while ``boost()`` builds the engine, at the end of the backward, and
inside ``ZeroOptimizer.step()``. Each term is something the runtime does; ``c`` is the
compute dtype's bytes, ``n`` the ZeRO group (dp x cp), ``psi`` this rank's parameter
elements, ``psi_f`` those of its largest flat buffer (stages 0-2: a 25 MiB bucket; stage 3:
its largest unit), ``Psi`` the serial model's elements.

- Building (`build_peak`): the caller builds the whole serial model in fp32 on every rank
  (``4 Psi``), then each ``FlatParam`` stages its parameters in an fp32 buffer (``4 psi_f``,
  the flat itself in fp32; freed after a cast when ``c < 4``, which also makes the compute
  copy ``c psi_f`` and a master shard ``4 psi_f / n``). The original parameters are freed as
  the flats take them over, so the peak is the first flat's. Under tensor parallelism the
  peak can come earlier: ``parallelize`` makes this rank's shard of every layer of the whole
  model, every pipeline stage's (``4 Psi_tp``: the tp rank's elements before the pipeline
  cut, less those it leaves in place, `ModelShape.unsplit_params`), while the caller's serial
  parameters stay referenced (by the optimizer handed to ``boost()``, which is rebuilt only
  afterwards, and under a pipeline by the serial blocks kept for the check), so
  ``4 Psi + 4 Psi_tp`` are resident at once.
- Kept between steps (`kept_grad_buffers`): ZeRO reuses its flat gradient buffers from
  step to step instead of allocating them anew: stage 0 each flat's (``c psi``), stages
  1-2 a free list of at most two of the largest flat's size (``min(2, flats) c psi_f``),
  resident through the forward and backward.
- End of backward (`gradient_peak`): stages 0-1 accumulate into the flat gradient buffer
  (counted as model state); stage 2 outside ``accumulating()`` gets every gradient from
  autograd as a new tensor before the flat's reduce-scatter copies and frees them: ``c psi``
  at once when the last layer's backward finishes, by which time the activations are freed.
  The rank holds the larger of the two (activations early, gradients late). At stages 1-3
  on ``n > 2`` ranks the ring reduce-scatter (``comm.gloo_ring``) alternates between its
  output shard and one temporary chunk: ``c psi_f / n`` more while it runs.
- Optimizer step (`step_scratch`): with activations freed, ``torch.optim.AdamW`` (single
  tensor path, one flat buffer at a time) allocates ``sqrt(v)`` and its quotient, two fp32
  temporaries of the shard: ``8 psi_f / n``; mixed precision without offload first casts
  the shard's gradient to fp32 (``4 psi_f / n``); at stages 1-2 on ``n > 1`` ranks the updated
  shard is cast to the compute dtype for its all-gather (``c psi_f / n``).
- SUMMA's backward (`summa_backward`, 2D and 2.5D): ``two_d.linear._Summa.backward`` of the
  widest layer (fc_out, ``r d`` inputs) holds at once the ``q`` partial input gradients and
  their concatenation (``2 q`` blocks of its input ``T r d/q``), the ``q`` partial weight
  gradients and their stack (``2 q`` blocks ``r (d/q)^2``), and two prefetched steps of
  broadcast input and weight blocks: ``c (2 q + 2) (T r d/q + r (d/q)^2)``, with ``T`` the
  rank's tokens (``B S / q``; 2.5D: ``/ (q depth)``), on top of the saved activations.
- Zero-bubble schedules (`kept_gradients`): between a microbatch's B and its W, the split
  backward (``pipeline.split_backward``) keeps the output gradient of every node a weight
  gradient hangs off: q, k, v and fc_in (``(3 + r) s b h`` elements per layer, split ``tp``
  ways), out_proj, fc_out and the two LayerNorms (``4 s b h``, split only when the residual
  stream is: Megatron SP, 2D/2.5D/3D), for each microbatch the rank holds.
- 3D tensor parallelism (`activations_3d`): each ``Linear3D`` keeps its all-gathered input
  and weight for backward, which the generic ``1/tp`` split of `memory.activation_bytes`
  misses; the count of ``tessera.tensor_parallel.three_d.activations`` replaces it (with
  ``T = B S / q^2`` tokens of a rank's microbatch, ``d`` = hidden / q): per layer
  ``c T d (6 + r + q (5 + r)) + T (8 + 4 H/q) + 2 c d + c d^2 (4 + 2 r)`` (norms, q/k/v and
  attention output, the GELU input, the gathered inputs of q, k, v, out_proj, fc_in and
  fc_out, fp32 statistics, the gathered weights), the head ``c T (d + V/q) + c q T d + c d V/q
  + 14 T + c d`` and the embedding's ids ``8 B S + 8 S + 4``.
"""

from __future__ import annotations

from tessera.planner.memory import DTYPE_BYTES
from tessera.planner.model import ModelShape

__all__ = [
    "activations_3d",
    "build_peak",
    "gradient_peak",
    "kept_grad_buffers",
    "kept_gradients",
    "step_scratch",
    "summa_backward",
]


def build_peak(
    serial: float, psi_f: float, *, precision: str, n: int, stage: int, tp_share: float = 0.0
) -> float:
    """Bytes resident while ``boost()`` builds a rank's engine: the caller's fp32 model and
    the larger of the first flat's fp32 staging (with its compute copy and master shard under
    mixed precision) and, under tensor parallelism, the fp32 shards ``parallelize`` makes of
    the whole model (``tp_share``: the elements it copies for the tp rank over every pipeline
    stage; 0 without tensor parallelism)."""
    c = DTYPE_BYTES[precision]
    shards = n if stage >= 1 else 1
    staging = 4 * psi_f + (c * psi_f + 4 * psi_f / shards if c != 4 else 0.0)
    return 4 * serial + max(staging, 4 * tp_share)


def kept_grad_buffers(psi: float, psi_f: float, flats: int, *, precision: str, stage: int) -> float:
    """Flat gradient buffers ZeRO keeps from one step to the next (``FlatParam``'s buffer
    reuse, as DDP keeps its buckets), resident through the forward and backward: stage 0
    keeps each flat's buffer (``c psi``), stages 1-2 a shared free list of at most two
    buffers of the largest flat (``min(2, flats) c psi_f``); stage 3 allocates per unit."""
    c = DTYPE_BYTES[precision]
    if stage == 0:
        return c * psi
    if stage in (1, 2):
        return min(2, flats) * c * psi_f
    return 0.0


def gradient_peak(
    psi: float, psi_f: float, *, precision: str, n: int, stage: int, one_reduction: bool
) -> float:
    """Bytes of gradients outside the model state at the end of a backward (stage 2 outside
    ``accumulating()``: autograd's tensors before the flat copies them) and the ring
    reduce-scatter's temporary chunk."""
    c = DTYPE_BYTES[precision]
    autograd = c * psi if stage == 2 and not one_reduction else 0.0
    ring = c * psi_f / n if stage >= 1 and n > 2 else 0.0
    return autograd + ring


def step_scratch(psi_f: float, *, precision: str, n: int, stage: int, offload: bool, optimizer: str) -> float:
    """Temporaries inside ``step()`` for the largest flat buffer, beyond the model state."""
    c = DTYPE_BYTES[precision]
    shard = psi_f / (n if stage >= 1 else 1)
    adam = 8 * shard if optimizer in ("adam", "adamw") and not offload else 0.0
    cast = 4 * shard if c != 4 and not offload else 0.0
    gather = c * shard if stage in (1, 2) and n > 1 else 0.0
    return adam + cast + gather


def activations_3d(
    model: ModelShape, rows: float, precision: str, q: int, cp: int
) -> tuple[float, float, float]:
    """(embedding, per layer, head) bytes a 3D rank saves for backward for one microbatch of
    ``rows`` sequences: ``three_d/activations.py``'s count, in the compute dtype (the
    embedding keeps the token and position ids; its output is the first layer's input)."""
    c = DTYPE_BYTES[precision]
    d, r = model.hidden / q, model.mlp_ratio
    t = rows * model.seq / cp / (q * q)  # tokens of a rank
    stats = t * (8 + 4 * model.heads / q)  # LayerNorm rstd and attention log-sum-exp, fp32
    layer = c * t * d * (6 + r + q * (5 + r)) + stats + 2 * c * d + c * d * d * (4 + 2 * r)
    v = model.vocab / q
    embed = 8 * rows * model.seq + 8 * model.seq + 4
    head = c * t * (d + v) + c * q * t * d + c * v * d + 14 * t + c * d
    return embed, layer, head


def summa_backward(model: ModelShape, rows: float, precision: str, q: int, depth: int, cp: int) -> float:
    """Bytes SUMMA's backward of the widest linear layer (fc_out) holds beyond the saved
    activations, for one microbatch of ``rows`` sequences on a q x q (x depth) grid."""
    c = DTYPE_BYTES[precision]
    d, r = model.hidden / q, model.mlp_ratio
    t = rows * model.seq / cp / (q * depth)
    return c * (2 * q + 2) * (t * r * d + r * d * d)


def kept_gradients(
    model: ModelShape, rows: float, precision: str, tp: int, split_stream: bool, cp: int
) -> float:
    """Bytes of output gradients one layer keeps between B and W (zero-bubble) for one
    microbatch of ``rows`` sequences: q, k, v and fc_in's split ``tp`` ways, out_proj's,
    fc_out's and the two norms' split too only when the residual stream is (``split_stream``)."""
    sbh = DTYPE_BYTES[precision] * rows * model.seq / cp * model.hidden
    return sbh * ((3 + model.mlp_ratio) / tp + 4 / (tp if split_stream else 1))
