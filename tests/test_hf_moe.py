"""HF Mixtral and Qwen2-MoE (built from tiny configs, random weights, nothing downloaded):
their sparse MoE blocks converted to ``tessera.moe.MoE`` compute the same outputs and
gradients (tier 0), the converted models the same logits, and a converted Mixtral trains
through ``boost()`` at dp=2 (ZeRO 1 and 3), tp=2 (its experts whole on both ranks),
dp=2 x ep=2 (its experts split, ZeRO 1 and 3) and pp=2 (Llama's pipeline blocks), and a
converted Qwen2-MoE at dp=2 x ep=2 and tp=2, as they do serially, and its consolidated
weights load back into transformers (tier 2, the worker pool).

Tolerances: block outputs and gradients fp32 rtol 1e-5, atol 1e-6: the same products, with
HF's ``F.linear`` against a transposed copy and per-expert loops against one batched matmul,
so only the summation order differs. Losses rel 1e-5 and SGD weights rtol 1e-5, atol 1e-6, as
in ``test_user_models.py``; the consolidated model's logits in transformers rtol and atol
1e-5 (logits of order 1 from weights equal to 1e-6 after 3 SGD steps). A wrong weight
mapping (gate and up swapped, a missing transpose, no renormalisation, no shared gate)
changes outputs at order 1.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost, model_spec
from tessera.launcher.families.hf_moe import (
    MIXTRAL_PLAN,
    convert_hf_moe,
    hf_moe_state_dict,
    is_hf_sparse_moe,
    moe_from_hf,
)
from tessera.launcher.testing import RandomTokens, assert_matches_serial, serial_run, sgd
from tessera.moe import MoE

transformers = pytest.importorskip("transformers", reason="transformers is not installed: HF MoE NOT tested")

TOL = {"rtol": 1e-5, "atol": 1e-6}
VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 4, 3, 0.2


def _mixtral(**changes: Any) -> nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        **changes,
    )
    return _randomised(transformers.MixtralForCausalLM(config))


def _qwen2_moe() -> nn.Module:
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=20,
        moe_intermediate_size=12,
        shared_expert_intermediate_size=20,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        max_position_embeddings=32,
    )
    return _randomised(transformers.Qwen2MoeForCausalLM(config))


def _randomised(model: nn.Module) -> nn.Module:
    """Every parameter drawn anew from seed 0 (HF leaves Qwen2-MoE's routers at zero, where
    every expert ties)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_hf_sparse_moe(m)]


@pytest.mark.parametrize("build", [_mixtral, _qwen2_moe], ids=["mixtral", "qwen2-moe"])
def test_a_converted_block_computes_what_hf_computes(build: Any) -> None:
    block = _blocks(build())[0]
    layer = moe_from_hf(block)
    assert isinstance(layer, MoE) and layer.capacity_factor is None
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    g = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2))
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = block(x_hf), layer(x_ours)
    torch.testing.assert_close(got, want, **TOL)
    (want * g).sum().backward()
    (got * g).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad, **TOL)
    hf: Any = block
    h = hf.experts.gate_up_proj.shape[1] // 2
    gate_up, down = hf.experts.gate_up_proj.grad, hf.experts.down_proj.grad
    assert layer.experts.w3 is not None and layer.experts.w3.grad is not None
    torch.testing.assert_close(layer.router.weight.grad, hf.gate.weight.grad, **TOL)
    torch.testing.assert_close(layer.experts.w1.grad, gate_up[:, :h].transpose(1, 2), **TOL)
    torch.testing.assert_close(layer.experts.w3.grad, gate_up[:, h:].transpose(1, 2), **TOL)
    torch.testing.assert_close(layer.experts.w2.grad, down.transpose(1, 2), **TOL)
    if layer.shared_gate is not None:
        assert layer.shared is not None
        torch.testing.assert_close(layer.shared_gate.grad, hf.shared_expert_gate.weight.grad, **TOL)
        torch.testing.assert_close(layer.shared.w2.grad[0], hf.shared_expert.down_proj.weight.grad.t(), **TOL)


@pytest.mark.parametrize("build", [_mixtral, _qwen2_moe], ids=["mixtral", "qwen2-moe"])
def test_a_converted_model_gives_the_same_logits(build: Any) -> None:
    model = build()
    converted = copy.deepcopy(model)
    assert convert_hf_moe(converted) == (2 if "Mixtral" in type(model).__name__ else 1)
    assert not _blocks(converted) and any(isinstance(m, MoE) for m in converted.modules())
    assert any(n.endswith("mlp.experts.w1") for n, _ in converted.named_parameters())
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(converted(ids).logits, model(ids).logits, **TOL)


@pytest.mark.parametrize("build", [_mixtral, _qwen2_moe], ids=["mixtral", "qwen2-moe"])
def test_a_converted_models_weights_load_back_into_transformers(build: Any) -> None:
    converted = build()
    convert_hf_moe(converted)
    with torch.no_grad():  # weights of its own, so a load that kept the old ones would show
        for p in converted.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    fresh = build()
    fresh.load_state_dict(hf_moe_state_dict(converted.state_dict(), like=fresh), strict=True)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(fresh(ids).logits, converted(ids).logits, **TOL)


def test_blocks_it_cannot_reproduce_are_refused() -> None:
    with pytest.raises(ValueError, match=r"router_jitter_noise=0\.1 is not reproduced"):
        moe_from_hf(_blocks(_mixtral(router_jitter_noise=0.1))[0])
    with pytest.raises(ValueError, match="output_router_logits=True"):
        convert_hf_moe(_mixtral(output_router_logits=True))
    with pytest.raises(ValueError, match="is not a Mixtral / Qwen2-MoE sparse MoE block"):
        moe_from_hf(nn.Linear(2, 2))


def test_the_plans_replicate_each_layers_mixture() -> None:
    model = _mixtral()
    assert model_spec(model).roles is MIXTRAL_PLAN
    plan = MIXTRAL_PLAN.as_dict()
    assert plan["model.layers.*.mlp"].name == "replicate"
    assert not any(p.startswith("model.layers.*.mlp.") for p in plan)
    assert model_spec(_qwen2_moe()).roles is not None


# ---------------------------------------------------------------------------- through boost()
def _build(name: str = "mixtral") -> nn.Module:
    model = _mixtral() if name == "mixtral" else _qwen2_moe()
    convert_hf_moe(model)
    return model


TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)


Run = tuple[list[float], dict[str, Tensor]]


def _serial(name: str = "mixtral") -> Run:
    return serial_run(_build(name), TOKENS.first(STEPS), sgd(LR))


# MIXTRAL_PLAN with each mixture split inside its experts over tp (the ``moe`` style), which
# takes Megatron SP: each layer gathers the sequence and routes the whole tokens
SPLIT = {**MIXTRAL_PLAN.as_dict(), "model.layers.*.mlp": "moe"}


def _parallel(rank: int, config: Config, name: str, plan: Any = None) -> Run:
    model = _build(name)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config, plan=plan)
    losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
    weights = engine.full_state_dict()  # at ep > 1 each expert bank gathered over the ep group
    engine.mesh.close()
    return losses, weights


def _train_and_consolidate(rank: int, config: Config, path: str) -> list[float]:
    model = _build()
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config)
    losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
    engine.consolidate(path)
    engine.close()
    return losses


@pytest.mark.parametrize(
    "parallel", [ParallelConfig(dp=2, tp=2, microbatches=1), ParallelConfig(dp=2, ep=2, microbatches=1)]
)
def test_a_mixtral_trained_through_boost_loads_into_transformers(
    worker_pools: PoolFactory, tmp_path: Path, parallel: ParallelConfig
) -> None:
    """dp=2 x tp=2, and dp=2 x ep=2 (each rank holds half of every layer's experts):
    consolidated, mapped back to HF names, loaded strictly into a fresh
    ``MixtralForCausalLM``: its logits are the serially trained model's."""
    c = Config(
        parallel=parallel,
        zero=ZeroConfig(stage=1),
        train=TrainConfig(precision="fp32"),
    )
    config = dataclasses.replace(c, optim=dataclasses.replace(c.optim, clip_grad_norm=0.0))
    path = str(tmp_path / "model.safetensors")
    worker_pools(config.world_size).run(_train_and_consolidate, config, path, timeout=180)
    fresh = _mixtral()
    fresh.load_state_dict(hf_moe_state_dict(safetensors.torch.load_file(path), like=fresh), strict=True)
    _, weights = _serial()
    trained = _build()
    trained.load_state_dict(weights)
    ids, _ = TOKENS.at(99)
    torch.testing.assert_close(fresh(ids).logits, trained(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "parallel", "zero"),
    [
        ("mixtral", ParallelConfig(dp=2, microbatches=2), 1),
        ("mixtral", ParallelConfig(dp=2, microbatches=1), 3),
        ("mixtral", ParallelConfig(tp=2, microbatches=1), 0),
        ("mixtral", ParallelConfig(dp=2, ep=2, microbatches=1), 1),
        ("mixtral", ParallelConfig(dp=2, ep=2, microbatches=2), 3),
        ("mixtral", ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1),  # llama_blocks cut it
        ("qwen2-moe", ParallelConfig(dp=2, ep=2, microbatches=1), 1),  # the gated shared expert is dense
        ("qwen2-moe", ParallelConfig(tp=2, microbatches=1), 0),
        ("mixtral-split", ParallelConfig(tp=2, sequence_parallel=True, microbatches=1), 1),
        ("mixtral-split", ParallelConfig(dp=2, ep=2, tp=2, sequence_parallel=True, microbatches=1), 3),
    ],
)
def test_a_converted_model_trains_through_boost_as_serially(
    worker_pools: PoolFactory, name: str, parallel: ParallelConfig, zero: int
) -> None:
    c = Config(parallel=parallel, zero=ZeroConfig(stage=zero), train=TrainConfig(precision="fp32"))
    config = dataclasses.replace(c, optim=dataclasses.replace(c.optim, clip_grad_norm=0.0))
    plan = SPLIT if name == "mixtral-split" else None
    name = name.removesuffix("-split")
    results = worker_pools(config.world_size).run(_parallel, config, name, plan, timeout=180)
    assert_matches_serial(results, _serial(name))  # each rank: its pipeline stages' weights
