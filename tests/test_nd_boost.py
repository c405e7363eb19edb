"""A user's Llama-style model (``tessera.models.foreign.Llamaish``: RMSNorm with its weight
called ``scale``, rotary, SwiGLU, 2 KV heads of 4) through ``boost(..., plan=ROLES)`` in 2D
(tp=4) and 3D (tp=8) on the worker pool: one plan of roles, translated by boost to the mode in
use, trained 3 SGD (momentum) steps against the same model trained serially. Bounds: losses
rel 1e-5 (fp32 means over the batch, summed in another order over the grid), consolidated
weights rtol 1e-5 + atol 1e-6 (SGD is linear in the gradient, so the weights stay at
round-off); a lost or doubled gradient contribution is off by the size of an update.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.models.foreign import ForeignConfig, Llamaish
from tessera.tensor_parallel import Plan

CFG = ForeignConfig(vocab=64, dim=32, heads=4, kv_heads=2, layers=2, hidden=64, max_len=16)
BATCH, SEQ, STEPS, LR = 4, 8, 3, 0.5
ROLES = Plan.of(
    {
        "tok_embeddings": "vocab",
        "layers.*.attn_norm": "norm",
        "layers.*.attn": "attention",
        "layers.*.attn.wq": "colwise",
        "layers.*.attn.wk": "colwise",
        "layers.*.attn.wv": "colwise",
        "layers.*.attn.wo": "rowwise",
        "layers.*.ffn_norm": "norm",
        "layers.*.ffn": "region",
        "layers.*.ffn.w1": "colwise",
        "layers.*.ffn.w3": "colwise",
        "layers.*.ffn.w2": "rowwise",
        "norm": "norm",
        "output": "head",
    },
    name="llamaish-roles",
)
Run = tuple[list[float], dict[str, Tensor]]


def _batch(step: int) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, CFG.vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _serial() -> Run:
    model = Llamaish(CFG, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        ids, targets = _batch(step)
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        torch.autograd.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _parallel(rank: int, config: Config) -> Run:
    model = Llamaish(CFG, seed=0)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config, plan=ROLES)
    losses = [engine.train_step(*_batch(step)).loss for step in range(STEPS)]
    weights = engine.full_state_dict()
    engine.mesh.close()
    return losses, weights


@pytest.mark.parametrize(("tp", "mode"), [(4, "2d"), (8, "3d")])
def test_one_role_plan_through_boost_in_2d_and_3d(worker_pools: PoolFactory, tp: int, mode: str) -> None:
    c = Config(
        parallel=ParallelConfig(tp=tp, tp_mode=mode, microbatches=1),
        zero=ZeroConfig(stage=0),
        train=TrainConfig(precision="fp32"),
    )
    config = dataclasses.replace(
        c,
        data=dataclasses.replace(c.data, batch_size=BATCH),
        optim=dataclasses.replace(c.optim, clip_grad_norm=0.0),  # the serial run does not clip
    )
    results = worker_pools(tp).run(_parallel, config, timeout=180)
    losses, weights = _serial()
    merged: dict[str, Tensor] = {}
    for curve, part in results:
        assert curve == pytest.approx(losses, rel=1e-5)
        merged.update(part)
    torch.testing.assert_close(merged, weights, rtol=1e-5, atol=1e-6)
