"""The planner's transient-memory terms (`tessera.planner.transient`) against what the
runtime holds, checked cheaply in one process: the 3D layer's saved activations against the
tensor-parallel package's own count, and the output gradients a zero-bubble split backward
really keeps for W. (The other terms are checked by ``hatch run bench plan`` against the
resident set of real runs.)"""

from __future__ import annotations

import pytest
import torch

from tessera.comm import Mesh
from tessera.comm.testing import run_threaded
from tessera.launcher.config import ParallelConfig
from tessera.launcher.families import known  # noqa: F401  (registers the GPT's model spec)
from tessera.launcher.families.spec import model_spec
from tessera.models import GPT, GPTConfig
from tessera.pipeline.split_backward import backward_input, grad_nodes
from tessera.planner import ModelShape, TPShape
from tessera.planner.transient import activations_3d, build_peak, kept_gradients
from tessera.tensor_parallel import parallelize
from tessera.tensor_parallel.three_d.activations import activation_bytes_3d


@pytest.mark.parametrize(("q", "batch", "hidden"), [(2, 4, 64), (2, 8, 128), (3, 9, 96)])
def test_3d_activations_are_the_tensor_parallel_count(q: int, batch: int, hidden: int) -> None:
    """Exactly ``three_d.activations``' count (the same formula, fp32): per block, and for the
    embedding and head together."""
    model = ModelShape(layers=2, hidden=hidden, heads=2 * q, vocab=32 * q, seq=64, batch=batch)
    want = activation_bytes_3d(
        batch=batch, seq=64, hidden=hidden, heads=model.heads, vocab=model.vocab, q=q
    )
    embed, layer, head = activations_3d(model, batch, "fp32", q, 1)
    assert layer == pytest.approx(want.block, rel=1e-12)
    assert embed + head == pytest.approx(want.embed_head, rel=1e-12)


def test_kept_gradients_are_what_a_split_backward_keeps_for_w() -> None:
    """B of one transformer block keeps, until W, the output gradients of its six linear
    layers and two norms: ``(7 + r) s b h`` elements, exactly."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_heads=4, n_layers=1)
    block = GPT(cfg, seed=0).blocks()[1]  # the first transformer layer
    rows = 4
    x = torch.randn(rows, cfg.seq_len, cfg.d_model, requires_grad=True)
    out = block(x)
    params = [p for p in block.parameters() if p.requires_grad]
    _, weights = backward_input(out, torch.ones_like(out), x, params, grad_nodes(params))
    storages: dict[int, int] = {}
    for group in weights.groups:
        for grads in group.grads.values():
            for g in grads:
                if g is not None:
                    storages[g.untyped_storage().data_ptr()] = g.untyped_storage().nbytes()
    shape = ModelShape(layers=1, hidden=64, heads=4, vocab=64, seq=16, batch=rows)
    predicted = kept_gradients(shape, rows, "fp32", 1, False, 1)
    assert sum(storages.values()) == pytest.approx(predicted, rel=1e-12)


def _held_after_parallelize(rank: int, parallel: ParallelConfig, cfg: GPTConfig) -> tuple[int, int]:
    """(bytes of every parameter storage alive right after ``parallelize``, while the serial
    parameters stay referenced as the caller's optimizer references them in ``boost()``;
    bytes of the serial model alone)."""
    model = GPT(cfg, seed=0)
    serial = list(model.parameters())  # what the optimizer handed to boost() holds
    topology = parallel.topology()
    mesh = Mesh(topology)
    spec = model_spec(model)
    parallelize(model, plan=spec.plan(topology.tp_mode, model), mesh=mesh, sequence_parallel=False, seed=0)
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in [*serial, *model.parameters()]
    }
    alone = sum(t.untyped_storage().nbytes() for t in serial)
    return sum(storages.values()), alone


@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(tp=2),
        ParallelConfig(tp=4),
        ParallelConfig(tp=4, tp_mode="2d"),
        ParallelConfig(tp=8, tp_mode="2.5d", tp_depth=2),
        ParallelConfig(tp=8, tp_mode="3d"),
    ],
    ids=["1d-tp2", "1d-tp4", "2d-tp4", "2.5d-tp8", "3d-tp8"],
)
def test_build_peak_counts_the_tp_shards_beside_the_serial_model(parallel: ParallelConfig) -> None:
    """While ``boost()`` tensor-parallelises, the serial parameters (held by the caller's
    optimizer) and the rank's fresh shards of every layer are alive at once: ``build_peak``'s
    ``4 Psi + 4 Psi_tp`` is exactly their bytes (fp32, no flat staging yet), on every rank
    (the parameters tensor parallelism leaves in place counted once)."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    shape = ModelShape(layers=2, hidden=32, heads=4, vocab=64, seq=16, batch=4)
    serial = float(sum(shape.block_params()))
    tp = TPShape(parallel.tp_mode, parallel.tp, parallel.tp_depth)
    tp_share = float(sum(shape.block_params(tp)) - shape.unsplit_params(tp))
    results = run_threaded(parallel.tp, _held_after_parallelize, parallel, cfg)
    for held, alone in results:
        assert alone == 4 * serial
        assert held == build_peak(serial, 0.0, precision="fp32", n=1, stage=0, tp_share=tp_share)
