"""JetMoE's MLP mixture and Beam's block as `tessera.moe` layers.

JetMoE (``JetMoeMoE``): its experts sit on the block itself, ``input_linear.weight [E, 2h, d]``
(gate rows, then up) and ``output_linear.weight [E, d, h]`` (the ``parallel_experts`` bank
layout), its router ``router.layer`` takes the softmax of the top-k logits, and it adds a bias
``[d]`` to its output: `tessera.moe.output_bias.OutputBiasMoE`. Its attention is a mixture too
(JetMoeMoA: query and output projections per expert, the same two tensor names, not gated,
called through ``map`` / ``reduce``); it is no MLP block, is left as it is, trains replicated
(data parallel) beside the expert-parallel MLP, and the roles derived at tp keep it whole.
Beam (``BeamMoE``): DeepSeek-V3's router (sigmoid, choice bias, 2 of 4 groups by their top-2
scores), the routed scale applied by the block after the sum, its experts' SwiGLU in fp32
(``SwiGLUVariant(float32=True)``; the same in the fp32 models here); its full-attention layers
have no rotary embeddings but a query scale of the positions. Each model is the tiny one of
``tessera.launcher.testing_hf_moe`` (8 experts, top-2, hidden 32, random weights).

Tier 0: each converted block computes HF's block's outputs and gradients (the input's, the
router's, every expert weight's, JetMoE's bias'); the detail matters (JetMoE's bias, Beam's
scale, each left out, compute something else); each converted model gives HF's logits; its
weights, mapped back to transformers' names, load strictly into a fresh model that then gives
the converted model's logits; what ``boost()`` exports are transformers' tensors; JetMoE's
attention mixture is not taken for a block; the derived tp roles keep both attentions whole;
Beam's pipeline blocks (``hf.decoder_blocks``) make its NoPE layers' query scale and, chained,
give its logits.

Tier 2 (the worker pool): each family through ``boost()`` at dp=2 x ep=2 with ZeRO-1 and ZeRO-3,
and with no plan at tp=2 (the derived roles: each mixture ``moe``, JetMoE's output bias taking
its gradient on the group's first rank; JetMoE's and Beam's attentions kept whole) and at pp=2
(1F1B, 2 microbatches), each equal to the serial run (3 SGD steps, momentum 0.9); a model built
deferred (meta) is made by ``boost()`` at dp=2 x ep=2, ZeRO-3, element for element as an eager
one initialised by name. ``OutputBiasMoE`` under sequence parallelism (which no derived plan
gives JetMoE, its attention being kept whole) is ``packages/moe/tests/test_moe_output_bias.py``'s.

Tolerances: block outputs and gradients fp32 rtol 1e-5, atol 1e-5 (the same products, HF's
per-expert loops against one batched matmul: only the summation order differs; these blocks'
outputs and input gradients reach 20, where one fp32 ulp is 2e-6, and an element near zero
after cancellation keeps that absolute error, measured 4e-6 at most); logits rtol and atol
1e-5 (order 1); losses rel 1e-5 and SGD weights rtol 1e-5, atol 1e-6 (`assert_matches_serial`'s
bounds: round-off of a few SGD steps); deferred against eager exactly (the same draws).
"""

from __future__ import annotations

import copy
import dataclasses
from functools import partial
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, boost
from tessera.launcher.families.derived_roles import derive_roles
from tessera.launcher.families.hf import decoder_blocks
from tessera.launcher.families.hf_moe import (
    convert_hf_moe,
    is_hf_sparse_moe,
    moe_from_hf,
)
from tessera.launcher.families.hf_moe_routing import read_layout
from tessera.launcher.testing import RandomTokens, assert_matches_serial, oracle_config, serial_run, sgd
from tessera.launcher.testing_hf_moe import (
    assert_converts_with_the_same_logits,
    assert_export_parts_are_transformers_tensors,
    assert_weights_load_back,
)
from tessera.launcher.train.deferred import deferred_parameters, init_by_name
from tessera.moe import MoE, SwiGLUVariant
from tessera.moe.output_bias import OutputBiasMoE

transformers = pytest.importorskip("transformers", reason="transformers is not installed: HF MoE NOT tested")
testing_hf_moe = pytest.importorskip("tessera.launcher.testing_hf_moe")

close = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)  # blocks: outputs, gradients
close_logits = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)
VOCAB, SEQ, BATCH, STEPS, LR, SEED = 64, 8, 4, 3, 0.2, 11
FAMILIES = ["jetmoe", "beam"]


def _build(family: str) -> Any:
    model: Any = testing_hf_moe.tiny_moe_model(family)
    model.config.use_cache = False
    return model


def _ids(seed: int) -> Tensor:
    return testing_hf_moe.token_ids(seed)  # type: ignore[no-any-return]


def _hf_grads(block: Any, family: str) -> dict[str, Tensor]:
    """HF's expert gradients as the converted bank's ``w1`` / ``w3`` / ``w2`` (``[E, d, h]``,
    ``[E, d, h]``, ``[E, h, d]``)."""
    if family == "jetmoe":
        gate_up, down = block.input_linear.weight.grad, block.output_linear.weight.grad
    else:
        gate_up, down = block.experts.gate_up_proj.grad, block.experts.down_proj.grad
    h = gate_up.shape[1] // 2
    return {
        "w1": gate_up[:, :h].transpose(1, 2),
        "w3": gate_up[:, h:].transpose(1, 2),
        "w2": down.transpose(1, 2),
    }


# ---------------------------------------------------------------------------- tier 0
@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_block_computes_what_hf_computes(family: str) -> None:
    block: Any = testing_hf_moe.sparse_blocks(_build(family))[0]
    layout = read_layout(block)
    layer = moe_from_hf(block)
    assert isinstance(layer, OutputBiasMoE) == (family == "jetmoe")
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    g = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2))
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = block(x_hf), layer(x_ours)
    close(got, want)
    (want * g).sum().backward()
    (got * g).sum().backward()
    close(x_ours.grad, x_hf.grad)
    close(layer.router.weight.grad, block.get_parameter(layout.router_weight).grad)
    assert layer.experts.w3 is not None
    for w, grad in _hf_grads(block, family).items():
        close(getattr(layer.experts, w).grad, grad)
    if isinstance(layer, OutputBiasMoE):
        close(layer.bias.grad, block.bias.grad)


def test_what_is_read_of_each_block() -> None:
    jet = read_layout(testing_hf_moe.sparse_blocks(_build("jetmoe"))[0])
    assert (jet.bank, jet.out_bias, jet.router_weight) == ("parallel_experts", "bias", "router.layer.weight")
    assert jet.renormalize and jet.routing.is_default and (jet.experts, jet.hidden, jet.top_k) == (8, 64, 2)
    beam = read_layout(testing_hf_moe.sparse_blocks(_build("beam"))[0])
    spec = beam.routing
    assert (spec.score, spec.choice_bias, spec.groups, spec.top_groups, spec.group_score) == (
        "sigmoid",
        True,
        4,
        2,
        "top2",
    )
    assert spec.scale == 2.5 and beam.renormalize and beam.score_bias == "gate.e_score_correction_bias"
    assert beam.activation == SwiGLUVariant(float32=True)  # its effect shows below fp32 only


@pytest.mark.parametrize("family", FAMILIES)
def test_the_detail_decides_the_output(family: str) -> None:
    """Read without its detail, the block computes something else on these inputs (so the tests
    above could fail): JetMoE's output bias left out, Beam's block scale left out."""
    block: Any = testing_hf_moe.sparse_blocks(_build(family))[0]
    layer = moe_from_hf(block)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x)
        close(layer(x), want)
        if isinstance(layer, OutputBiasMoE):
            layer.bias.zero_()
        else:
            layer.router.spec = dataclasses.replace(layer.router.spec, scale=1.0)
        assert not torch.allclose(layer(x), want, rtol=1e-5, atol=1e-6)


def test_jetmoes_attention_mixture_is_no_block() -> None:
    """JetMoeMoA holds ``input_linear`` / ``output_linear`` and a ``router`` as the MLP does; it is
    neither found nor converted, and stays JetMoE's own module, computing what it did."""
    model = _build("jetmoe")
    attention = model.model.layers[0].self_attention
    assert not is_hf_sparse_moe(attention) and not is_hf_sparse_moe(attention.experts)
    found = [n for n, m in model.named_modules() if is_hf_sparse_moe(m)]
    assert found == ["model.layers.0.mlp", "model.layers.1.mlp"]
    converted = copy.deepcopy(model)
    assert convert_hf_moe(converted) == 2
    kept = converted.model.layers[0].self_attention.experts
    assert type(kept).__name__ == "JetMoeMoA" and not isinstance(kept, MoE)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_model_is_transformers_model_both_ways(family: str) -> None:
    """Converted, it gives transformers' logits; its weights mapped back load strictly into a fresh
    model that then gives its logits; ``boost()``'s export parts are transformers' tensors
    (``tessera.launcher.testing_hf_moe``'s checks)."""
    assert_converts_with_the_same_logits(_build(family))
    assert_weights_load_back(lambda: _build(family))
    assert_export_parts_are_transformers_tensors(_build(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_derived_roles_keep_the_attention_whole(family: str) -> None:
    """At tp with no plan: each mixture ``moe``; JetMoE's attention (its mixture of heads, whose
    expert projections are no dense layers) and Beam's (a gate bias per head) whole on every
    rank, so the plan refuses sequence parallelism."""
    converted = _build(family)
    convert_hf_moe(converted)
    plan = derive_roles(converted)
    roles = {pattern: style.name for pattern, style in plan.entries}
    attention = "self_attention" if family == "jetmoe" else "self_attn"
    assert roles[f"model.layers.*.{attention}"] == "replicate"
    mixtures = [p for p, s in roles.items() if s == "moe"]
    assert mixtures == (["model.layers.*.mlp"] if family == "jetmoe" else ["model.layers.1.mlp"])
    assert not plan.supports_sequence_parallel


def test_beams_pipeline_blocks_give_its_logits() -> None:
    """Beam's full-attention layers have no rotary embeddings (``rope_parameters`` None) and take
    a query scale from the positions instead: the blocks ``boost()`` cuts into pipeline stages
    make it (``hf.decoder_blocks``), so chained they give the model's logits."""
    model: Any = _converted("beam")
    assert model.config.rope_parameters["full_attention"] is None
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    blocks = decoder_blocks(model)
    h = _ids(5)
    for block in blocks:
        h = block(h)
    close_logits(h, model(_ids(5)).logits)


# ---------------------------------------------------------------------------- tier 2
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)
Run = tuple[list[float], dict[str, Tensor]]


def _converted(family: str) -> nn.Module:
    model: nn.Module = _build(family)
    convert_hf_moe(model)
    return model


def _serial(family: str) -> Run:
    return serial_run(_converted(family), TOKENS.first(STEPS), sgd(LR))


def _parallel(rank: int, config: Config, family: str) -> Run:
    model = _converted(family)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config)
    try:
        losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
        weights = engine.full_state_dict()  # each expert bank gathered over the ep group
    finally:
        engine.mesh.close()
    return losses, weights


MODES = {
    "dp2-ep2-zero1": (ParallelConfig(dp=2, ep=2, microbatches=1), 1),
    "dp2-ep2-zero3": (ParallelConfig(dp=2, ep=2, microbatches=1), 3),
    "tp2": (ParallelConfig(tp=2, microbatches=1), 1),
    "pp2": (ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_family_trains_as_serially(worker_pools: PoolFactory, family: str, mode: str) -> None:
    """dp=2 x ep=2 (each rank routes its own tokens; JetMoE's attention mixture and output bias
    replicated and averaged as any dense parameter; ZeRO-3 shards each expert bank over edp), and
    with no plan written: tp=2 (the derived roles) and pp=2 (the decoder blocks ``boost()`` finds)."""
    parallel, zero = MODES[mode]
    config = oracle_config(parallel, zero, batch_size=BATCH)
    results = worker_pools(config.world_size).run(_parallel, config, family, timeout=180)
    assert_matches_serial(results, _serial(family))


def _initialized(rank: int, config: Config, family: str, deferred: bool) -> dict[str, Tensor]:
    """Each rank's full weights after ``boost()`` of a model built with its parameters deferred
    (meta; ``boost()`` makes each rank's share, a converted bank's from the HF tensors HF's init
    draws) or built whole and initialised by name, as ``boost()`` initialises a deferred one."""
    if deferred:
        with deferred_parameters():
            model = _build(family)
        assert all(p.is_meta for p in model.parameters())
    else:
        model = _build(family)
        init_by_name(model, SEED, None)
    with boost(model, torch.optim.SGD(model.parameters(), lr=LR), config) as engine:
        return {n: t.clone() for n, t in engine.full_state_dict().items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_deferred_model_is_made_as_an_eager_one(worker_pools: PoolFactory, family: str) -> None:
    """dp=2 x ep=2, ZeRO-3: JetMoE's banks made from ``input_linear`` / ``output_linear`` and its
    output bias from the block's ``bias``, Beam's from ``gate_up_proj``, element for element."""
    config = oracle_config(ParallelConfig(dp=2, ep=2, microbatches=1), 3, batch_size=BATCH, seed=SEED)
    pool = worker_pools(config.world_size)
    eager = pool.run(_initialized, config, family, False, timeout=180)
    deferred = pool.run(_initialized, config, family, True, timeout=180)
    for rank, (want, got) in enumerate(zip(eager, deferred, strict=True)):
        assert got.keys() == want.keys(), f"rank {rank}: {sorted(got.keys() ^ want.keys())}"
        wrong = [n for n in want if not torch.equal(got[n], want[n])]
        assert not wrong, f"rank {rank}: deferred values differ from eager for {wrong}"
