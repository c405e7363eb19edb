"""How many operators a layer and the model's edges launch under each parallel mode.

The planner charges every operator a fixed launch cost (`Cluster.op_overhead_s`, fitted by
``tessera plan --calibrate`` to the reference GPT's serial forward and backward counted as
``OPS_LAYER`` operators per layer and ``OPS_EDGE`` per edge, the embedding and the head with
its loss). Parallel modes launch more per layer: 1D tensor parallelism its all-reduces and
the copies around them, Megatron sequence parallelism its gathers and scatters, the grid
modes (SUMMA, Tesseract, 3D) a broadcast, a matmul and an accumulation per step of every
Linear, context parallelism its ring steps with their log-sum-exp merges or Ulysses'
all-to-alls with their reshapes. The tables hold the operators one training step dispatches
per layer and for the rest of the model (edges and optimizer), over the serial count, as a
``TorchDispatchMode`` counts them on the reference GPT (``q = 2`` for the grid modes: their
extra grows with the grid's side, ``q / 2`` for SUMMA and Tesseract, whose steps are ``q``
broadcasts each; ``q - 1`` for 3D). ``packages/launcher/tests/test_launcher_operators.py``
counts them again against these tables.
"""

from __future__ import annotations

from tessera.planner.layout import Layout

__all__ = ["OPS_EDGE", "OPS_LAYER", "operators"]

OPS_LAYER = 24  # operators one serial layer's forward launches (norms, projections, attention, MLP, adds)
OPS_EDGE = 6  # operators of the embedding or of the head and loss, serial

# dispatched per layer / rest of the model, over serial (serial: 180 per layer, 97 the rest,
# which holds the step's count of the targets that count: `tessera.launcher.train.objective`)
LAYER_RATIO = {"serial": 1.0, "1d": 1.39, "1d+sp": 2.13, "2d": 4.4, "2.5d": 5.78, "3d": 8.27}
EDGE_RATIO = {"serial": 1.0, "1d": 1.95, "1d+sp": 2.86, "2d": 4.57, "2.5d": 5.95, "3d": 6.67}
# what context parallelism adds, in the same units (the rest has counted a few operators
# more or fewer by whether its process ran other modes before: some lazily made state)
CONTEXT_LAYER = {"ring": 0.78, "ulysses": 0.87}
CONTEXT_EDGE = {"ring": 0.22, "ulysses": 0.22}


def _grid_scale(mode: str, side: int) -> float:
    """How a grid mode's extra operators grow with the grid's side (1 at ``q = 2``)."""
    if mode in ("2d", "2.5d"):
        return side / 2
    if mode == "3d":
        return float(side - 1)
    return 1.0


def operators(p: Layout) -> tuple[float, float]:
    """(operators per layer, per edge) ``p`` launches per microbatch's forward, in the serial
    forward's units (``OPS_LAYER``, ``OPS_EDGE`` for a serial model)."""
    mode = p.shape.mode
    if p.tp <= 1:
        key = "serial"
    elif mode == "1d":
        key = "1d+sp" if p.sequence_parallel else "1d"
    else:
        key = mode
    scale = _grid_scale(mode, p.shape.grid.side) if key in ("2d", "2.5d", "3d") else 1.0
    layer = 1.0 + (LAYER_RATIO[key] - 1.0) * scale
    edge = 1.0 + (EDGE_RATIO[key] - 1.0) * scale
    if p.cp > 1:
        layer += CONTEXT_LAYER[p.cp_mode.value]
        edge += CONTEXT_EDGE[p.cp_mode.value]
    return OPS_LAYER * layer, OPS_EDGE * edge
