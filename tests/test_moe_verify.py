"""``verify=True`` on mixtures of experts with router losses: every correct run passes, and a
broken expert-parallel step or a wrong expert slice is refused, naming the experts.

The model is HF Mixtral (tiny config, random weights, nothing downloaded) converted to
``tessera.moe.MoE`` layers. Its routers train on a load-balancing and a z-loss in two ways
a user writes them: inside each layer (``aux_loss_coef`` / ``z_loss_coef``: the engine scales
them by ``loss scale / microbatches``, the dp average by ``1 / dp``), or added by the loss
function, which reads the layers' ``aux_loss`` through a closure over the model. The
verifier's serial copy must weigh the first like the engine and read the copy's layers for
the second; either mistake differs from the parallel step by 5-50% in the router gradients,
far outside verify's fp32 tolerance (1e-4 of each gradient's scale).

Mutations, each made only inside the ranks of its test: the exchange's all-to-all without its
reordering (source-major rows run by the wrong local experts: a broken step, off at order 1
in the expert gradients), and each rank keeping the other rank's expert slice (a wrong start
that the gradient comparison alone cannot see, refused by the check of the weights before
the first step).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import BoostConfig, ParallelConfig, TrainConfig, ZeroConfig, boost, model_spec
from tessera.launcher.families.hf_moe import MIXTRAL_PLAN, convert_hf_moe
from tessera.launcher.testing import RandomTokens
from tessera.moe import MoE
from tessera.moe.exchange import exchange_rows
from tessera.moe.experts import Experts

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: MoE verify NOT tested"
)

VOCAB, SEQ, BATCH, LR, AUX = 64, 8, 8, 0.2, 0.05
SPLIT = {**MIXTRAL_PLAN.as_dict(), "model.layers.*.mlp": "moe"}  # experts split inside over tp


def _mixtral(inside: bool) -> nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights of order 1, so every router gradient is far from round-off
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    coef = AUX if inside else 0.0
    convert_hf_moe(model, aux_loss_coef=coef, z_loss_coef=coef)
    return model  # type: ignore[no-any-return]


TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)


def _config(parallel: ParallelConfig, zero: int) -> BoostConfig:
    train = TrainConfig(precision="fp32", verify=True)
    return BoostConfig(parallel=parallel, zero=ZeroConfig(stage=zero), train=train)


def _unordered_dispatch(rows: Tensor, ex: Any, group: Any) -> Tensor:
    return exchange_rows(rows, ex.send, ex.recv, group)  # source-major, taken as expert-major


def _unordered_combine(out: Tensor, ex: Any, group: Any) -> Tensor:
    return exchange_rows(out, ex.recv, ex.send, group)


_KEEP = Experts.keep


def _other_slice(bank: Experts, start: int, stop: int) -> None:
    """Keep the other rank's experts (ep = 2): rank 0 experts 2-3, rank 1 experts 0-1."""
    n = stop - start
    other = (start + n) % (2 * n)
    _KEEP(bank, other, other + n)


def _train(rank: int, config: BoostConfig, inside: bool, plan: Any, mutation: str) -> str:
    """Two verified steps; returns "" or the error verify raised."""
    model = _mixtral(inside)

    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        entropy = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        layers = [m for m in model.modules() if isinstance(m, MoE)]  # the closure reads `model`
        return entropy + AUX * sum((m.aux_loss + m.z_loss for m in layers), torch.zeros(()))

    patches: list[Any] = []
    if mutation == "unordered":
        patches = [
            mock.patch("tessera.moe.layer.dispatch", _unordered_dispatch),
            mock.patch("tessera.moe.layer.combine", _unordered_combine),
        ]
    elif mutation == "other-slice":
        patches = [mock.patch.object(Experts, "keep", _other_slice)]
    spec = dataclasses.replace(model_spec(model), loss=None if inside else loss)
    for p in patches:
        p.start()
    try:
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        engine = boost(model, opt, config, spec=spec, plan=plan)
        try:
            for step in range(2):
                engine.train_step(*TOKENS.at(step))
        except ValueError as e:
            return str(e)
        finally:
            engine.close()
    finally:
        for p in patches:
            p.stop()
    return ""


PASSING = [
    ("dp2-ep2-inside", ParallelConfig(dp=2, ep=2, microbatches=2), 3, True, None),
    ("dp2-ep2-closure", ParallelConfig(dp=2, ep=2, microbatches=1), 1, False, None),
    ("dp2-closure", ParallelConfig(dp=2, microbatches=2), 0, False, None),
    ("tp2-sp-split-inside", ParallelConfig(tp=2, sequence_parallel=True, microbatches=1), 1, True, SPLIT),
    ("dp2-ep2-tp2-split-inside", ParallelConfig(dp=2, ep=2, tp=2, microbatches=1), 1, True, SPLIT),
    ("pp2-inside", ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1, True, None),
]


@pytest.mark.parametrize(
    ("parallel", "zero", "inside", "plan"), [c[1:] for c in PASSING], ids=[c[0] for c in PASSING]
)
def test_verify_passes_a_correct_moe_step_with_router_losses(
    worker_pools: PoolFactory, parallel: ParallelConfig, zero: int, inside: bool, plan: Any
) -> None:
    config = _config(parallel, zero)
    assert config.validate() == []
    errors = worker_pools(config.world_size).run(_train, config, inside, plan, "", timeout=240)
    assert errors == [""] * config.world_size, errors[0]


@pytest.mark.parametrize(
    ("mutation", "named"),
    [
        ("unordered", r"differ: model\.layers\.\d\.mlp\.experts\.w"),
        ("other-slice", r"before any step.*experts\.w"),
    ],
)
def test_verify_refuses_a_broken_expert_parallel_step(
    worker_pools: PoolFactory, mutation: str, named: str
) -> None:
    config = _config(ParallelConfig(dp=2, ep=2, microbatches=1), 1)
    errors = worker_pools(2).run(_train, config, True, None, mutation, timeout=240)
    for error in errors:
        assert error, f"{mutation}: verify let a broken step through"
        assert "verify" in error and re.search(named, error), error
