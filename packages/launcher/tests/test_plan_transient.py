"""The planner's transient-memory terms (`tessera.launcher.plan.transient`) against what the
runtime holds, checked cheaply in one process: the 3D layer's saved activations against the
tensor-parallel package's own count, and the output gradients a zero-bubble split backward
really keeps for W. (The other terms are checked by ``hatch run bench plan`` against the
resident set of real runs.)"""

from __future__ import annotations

import pytest
import torch

from tessera.launcher.plan import ModelShape
from tessera.launcher.plan.transient import activations_3d, kept_gradients
from tessera.models import GPT, GPTConfig
from tessera.pipeline.split_backward import backward_input, grad_nodes
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
