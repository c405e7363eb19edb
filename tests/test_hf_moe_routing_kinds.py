"""HF MoE families whose routers differ from DeepSeek's in a detail `tessera.moe.RouterSpec`
or `tessera.moe.MoE` now says: Kolibri (chosen by the logits plus the bias, weighed by
``sigmoid(logit)``), AXK2 (the groups it drops masked to 0.0, not ``-inf``), LFM2-MoE (the
choice bias on the block, renormalised by ``sum + 1e-6``), LongCat-Flash (4 identity "zero"
experts after its 8 real ones) and AXK1 (DeepSeek-V3's block with an RMS norm of its
output). Each model is the survey's tiny one (``tests/survey_hf_moe.py``: 8 experts, top-2,
hidden 32, random weights), with LFM2's block bias drawn too and AXK2's biases lowered by 0.6,
so that its zero fill decides choices.

Tier 0: each converted block computes HF's block's outputs and gradients; the detail matters
(the block read without it, or with no token choosing an identity expert, computes something
else);
each converted model gives HF's logits, and its weights, mapped back to transformers' names,
load strictly into a fresh model that then gives the converted model's logits; LFM2's guard
is read (its effect, 1e-6 against sums near 1, is below the tolerance here; the unit tests
in ``packages/moe/tests/test_moe_routing_options.py`` show it).

Tier 2 (the worker pool): each family trained through ``boost()`` at dp=2 x ep=2 with ZeRO-1
and ZeRO-3 gives the serial run's losses and weights (3 SGD steps, momentum 0.9); Kolibri,
LongCat-Flash and AXK1 (plans of their own here) with their MoE layers split inside over tp
(the ``moe`` style) under sequence parallelism, at tp=2 and at dp=2 x ep=2 x tp=2 (ZeRO-3);
every family with no plan written at tp=2 (the derived roles: AXK2's adaptive norm, dense
layers beside a norm, kept whole; AXK1's post-norm taking its weight's gradient from each
rank's share of the tokens) and at pp=2 (1F1B, 2 microbatches: LFM2's rotary under the name
``pos_emb``, LongCat-Flash's two attentions per layer).

Tolerances: block outputs and gradients fp32 rtol 1e-5, atol 1e-5 (the same products, HF's
per-expert loops against one batched matmul: only the summation order differs; outputs and
gradients reach 10 here, and an entry near 0.1 that sums terms that large carries their
round-off: measured up to 4.1e-6 on an AMD EPYC, where 1e-6 had held elsewhere; a routing or
weight read wrong moves them by 1e-2 or more); logits rtol
and atol 1e-5 (order 1); losses rel 1e-5 and SGD weights rtol 1e-5, atol 1e-6 as in
``test_hf_moe_families.py``.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.families.hf_moe import (
    convert_hf_moe,
    moe_from_hf,
)
from tessera.launcher.families.hf_moe_routing import read_layout
from tessera.launcher.testing import RandomTokens, assert_matches_serial, serial_run, sgd
from tessera.launcher.testing_hf_moe import (
    assert_converts_with_the_same_logits,
    assert_export_parts_are_transformers_tensors,
    assert_weights_load_back,
    sparse_blocks,
    tiny_moe_model,
)
from tessera.zero import Precision

transformers = pytest.importorskip("transformers", reason="transformers is not installed: HF MoE NOT tested")

close = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)  # blocks: outputs, gradients
close_logits = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)
VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 4, 3, 0.2
FAMILIES = ["kolibri1", "axk2", "lfm2_moe", "longcat_flash", "axk1"]


def _build(family: str) -> Any:
    """The survey's model of ``family``; LFM2's block bias drawn (std 0.1), AXK2's biases
    lowered by 0.6 (so that experts of dropped groups, at 0.0, beat some kept ones)."""
    model: Any = tiny_moe_model(family)
    model.config.use_cache = False
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, b in sorted(model.named_buffers()):
            if family == "lfm2_moe" and name.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
            if family == "axk2" and name.endswith("e_score_correction_bias"):
                b.sub_(0.6)
    return model


# ---------------------------------------------------------------------------- tier 0
@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_block_computes_what_hf_computes(family: str) -> None:
    block: Any = sparse_blocks(_build(family))[0]
    layout = read_layout(block)
    layer = moe_from_hf(block)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    g = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2))
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = block(x_hf), layer(x_ours)
    close(got, want)
    (want * g).sum().backward()
    (got * g).sum().backward()
    close(x_ours.grad, x_hf.grad)
    close(layer.router.weight.grad, block.get_parameter(layout.router_weight).grad)
    gate_up, down = block.experts.gate_up_proj.grad, block.experts.down_proj.grad
    h = gate_up.shape[1] // 2
    assert layer.experts.w3 is not None
    close(layer.experts.w1.grad, gate_up[:, :h].transpose(1, 2))
    close(layer.experts.w3.grad, gate_up[:, h:].transpose(1, 2))
    close(layer.experts.w2.grad, down.transpose(1, 2))
    if layout.shared is not None:
        assert layer.shared is not None
        shared = block.get_submodule(layout.shared)
        assert layer.shared.w2.grad is not None
        close(layer.shared.w2.grad[0], shared.down_proj.weight.grad.t())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_detail_decides_the_output(family: str) -> None:
    """Read without its detail, the block computes something else on these inputs (so the
    tests above could fail): Kolibri chosen by the scores, AXK2's groups masked to ``-inf``,
    LongCat-Flash's tokens that choose an identity expert, LFM2's block bias left out, AXK1's
    norm left out."""
    block: Any = sparse_blocks(_build(family))[0]
    layer = moe_from_hf(block)
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x)
        if family == "kolibri1":
            layer.router.spec = dataclasses.replace(layer.router.spec, choose_by="scores")
        elif family == "axk2":
            layer.router.spec = dataclasses.replace(layer.router.spec, group_fill=float("-inf"))
        elif family == "axk1":
            assert layer.post_norm is not None
            layer.post_norm = None
        elif family == "lfm2_moe":
            assert layer.router.score_bias is not None
            layer.router.score_bias.zero_()
        else:
            choices = layer.router(x.reshape(-1, 32)).choices
            assert layer.identity_experts == 4 and int((choices >= layer.num_experts).sum()) > 0
            layer.router.weight[layer.num_experts :] = -1e4  # the identity experts never chosen
        assert not torch.allclose(layer(x), want, rtol=1e-5, atol=1e-5)


def test_lfm2s_guard_and_block_bias_are_read() -> None:
    layout = read_layout(sparse_blocks(_build("lfm2_moe"))[0])
    assert layout.routing.renorm_eps == 1e-6 and layout.score_bias == "expert_bias"
    assert layout.routing.score == "sigmoid" and layout.renormalize


@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_model_is_transformers_model_both_ways(family: str) -> None:
    """Converted, it gives transformers' logits; its weights mapped back load strictly into a fresh
    model that then gives its logits; ``boost()``'s export parts are transformers' tensors
    (``tessera.launcher.testing_hf_moe``'s checks)."""
    assert_converts_with_the_same_logits(_build(family))
    assert_weights_load_back(lambda: _build(family))
    assert_export_parts_are_transformers_tensors(_build(family))


# ---------------------------------------------------------------------------- tier 2
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)
Run = tuple[list[float], dict[str, Tensor]]


def _converted(family: str) -> nn.Module:
    model: nn.Module = _build(family)
    convert_hf_moe(model)
    return model


def _serial(family: str) -> Run:
    return serial_run(_converted(family), TOKENS.first(STEPS), sgd(LR))


def _parallel(rank: int, config: Config, family: str, plan: dict[str, str] | None) -> Run:
    model = _converted(family)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config, plan=plan)
    losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
    weights = engine.full_state_dict()  # each expert bank gathered over the ep group
    engine.mesh.close()
    return losses, weights


def _boost_config(parallel: ParallelConfig, zero: int) -> Config:
    """``parallel`` at ZeRO stage ``zero``, comparable with `serial_run`: fp32, no clipping."""
    c = Config(parallel=parallel, zero=ZeroConfig(stage=zero), train=TrainConfig(precision=Precision.FP32))
    return dataclasses.replace(c, optim=dataclasses.replace(c.optim, clip_grad_norm=0.0))


@pytest.mark.parametrize("zero", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_family_trains_at_ep2_as_serially(
    worker_pools: PoolFactory, family: str, zero: int
) -> None:
    """dp=2 x ep=2: each rank routes its own tokens (LongCat-Flash's identity experts on the
    rank, only the real experts' rows travel); ZeRO-3 shards each expert bank over edp."""
    config = _boost_config(ParallelConfig(dp=2, ep=2, microbatches=1), zero)
    results = worker_pools(config.world_size).run(_parallel, config, family, None, timeout=180)
    assert_matches_serial(results, _serial(family))


# tp plans: each family's attention split by heads, its MoE layers split inside over tp (the
# ``moe`` style) under Megatron sequence parallelism, the dense MLPs as Llama's
_ENDS = {"model.embed_tokens": "vocab_whole", "model.layers.0": "sequence_start", "model.norm": "norm"}
_DENSE = {"": "region", ".gate_proj": "colwise", ".up_proj": "colwise", ".down_proj": "rowwise"}
PLANS: dict[str, dict[str, str]] = {
    "kolibri1": {  # Qwen3-MoE's attention (q_norm, k_norm whole), sandwich norms
        **_ENDS,
        "lm_head": "head",
        **{f"model.layers.*.{n}": "norm" for n in ("input_layernorm", "post_attention_layernorm")},
        **{f"model.layers.*.{n}": "norm" for n in ("post_self_attn_layernorm", "post_mlp_layernorm")},
        "model.layers.*.self_attn": "attention",
        **{f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp": "moe",
    },
    "longcat_flash": {  # two latent attentions and two dense MLPs per layer, the MoE beside them
        **_ENDS,
        "lm_head": "head",
        **{f"model.layers.*.{n}.*": "norm" for n in ("input_layernorm", "post_attention_layernorm")},
        "model.layers.*.self_attn.*": "attention",
        **{f"model.layers.*.self_attn.*.{p}": "colwise" for p in ("q_b_proj", "kv_b_proj")},
        "model.layers.*.self_attn.*.o_proj": "rowwise",
        **{f"model.layers.*.mlps.*{k}": v for k, v in _DENSE.items()},
        "model.layers.*.mlp": "moe",
    },
    "axk1": {  # DeepSeek-V3's latent attention; layer 0 dense, layer 1 the MoE and its post-norm
        **_ENDS,
        "lm_head": "head",
        **{f"model.layers.*.{n}": "norm" for n in ("input_layernorm", "post_attention_layernorm")},
        "model.layers.*.self_attn": "attention",
        **{f"model.layers.*.self_attn.{p}": "colwise" for p in ("q_b_proj", "kv_b_proj")},
        "model.layers.*.self_attn.o_proj": "rowwise",
        **{f"model.layers.0.mlp{k}": v for k, v in _DENSE.items()},
        "model.layers.1.mlp": "moe",
    },
}
SPLIT_MODES = {
    "tp2-sp": (ParallelConfig(tp=2, sequence_parallel=True, microbatches=1), 1),
    "dp2-ep2-tp2-sp": (ParallelConfig(dp=2, ep=2, tp=2, sequence_parallel=True, microbatches=1), 3),
}


@pytest.mark.parametrize("mode", list(SPLIT_MODES))
@pytest.mark.parametrize("family", list(PLANS))
def test_a_converted_family_split_over_tp_trains_as_serially(
    worker_pools: PoolFactory, family: str, mode: str
) -> None:
    """The MoE layers split inside over tp with sequence parallelism (every tp rank routes the
    same whole tokens; LongCat-Flash's identity experts added on one rank of the group; AXK1's
    norm applied to each rank's slice of the sequence), alone and with dp=2 x ep=2 around them
    (ZeRO-3)."""
    config = _boost_config(*SPLIT_MODES[mode])
    results = worker_pools(config.world_size).run(_parallel, config, family, PLANS[family], timeout=180)
    assert_matches_serial(results, _serial(family))


NO_PLAN_MODES = {
    "tp2": (ParallelConfig(tp=2, microbatches=1), 1),
    "pp2": (ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1),
}


@pytest.mark.parametrize("mode", list(NO_PLAN_MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_family_trains_with_no_plan_at_tp2_and_pp2(
    worker_pools: PoolFactory, family: str, mode: str
) -> None:
    """No plan written: at tp=2 the roles ``boost()`` derives (each mixture ``moe``, attention by
    heads); at pp=2 (1F1B, 2 microbatches) the decoder blocks ``boost()`` finds."""
    config = _boost_config(*NO_PLAN_MODES[mode])
    results = worker_pools(config.world_size).run(_parallel, config, family, None, timeout=180)
    assert_matches_serial(results, _serial(family))
