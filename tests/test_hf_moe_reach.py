"""HF MoE families the survey could not reach until their configs were made to build at its tiny
sizes (`tessera.launcher.testing_hf_moe.FIXES`): Kolibri 1.1 (Kolibri's router and DeepSeek-V3's
block behind an indexed sparse attention), Qwen4-Exp (Qwen2-MoE's gated shared expert behind
hyper-connected residual streams, gated-delta-net and indexed attention) and dots3 Note
(DeepSeek-V3's router and block behind latent attention, per-layer sliding-window sizes and a DSA
indexer), which convert with the kinds that exist; Gemma 4 (``enable_moe_block``), whose
mixture inside its decoder layers ``boost()`` converts (``tests/test_hf_moe_gemma4.py`` holds
the rest); and Doge's product-key mixture (``is_moe``), which holds no expert bank and is not
converted. Each model is ``tiny_moe_model``'s (8 experts, top-2, hidden 32, random weights).

Tier 0: each converted block computes HF's block's outputs and gradients; each converted
model gives HF's logits, and its weights, mapped back to transformers' names, load strictly
into a fresh model that then gives the converted model's logits; ``boost()``'s export parts
assemble each converted tensor from transformers' ones. Doge's block is shown to mix tokens of
different rows (its router's ``view(2, tokens, -1)``), which no per-token router reproduces.

Tier 2 (the worker pool): each converting family trained through ``boost()`` at dp=2 x ep=2
with ZeRO-1 and ZeRO-3, at tp=2 with no plan (the derived roles; dots3 Note's attention sizes per
layer, read from each attention, as its config refuses to give them globally) and at pp=2 (1F1B,
2 microbatches, the decoder blocks ``boost()`` finds) gives the serial run's losses and weights
(3 SGD steps, momentum 0.9); Gemma 4, its mixtures converted by ``boost()`` itself, trains at
dp=2 and tp=2 (derived roles) as its unconverted HF model does serially (at pp=2:
``test_hf_pp_gemma4_dsv4.py``); Doge's mixture is refused wherever the batch is split.

Tolerances: block outputs and gradients fp32 rtol 1e-5, atol 1e-5 (the same products, HF's
per-expert loops against one batched matmul: only the summation order differs; outputs and
gradients reach 10 here, and an entry near 0.1 that sums terms that large carries their
round-off: measured up to 4.1e-6 on an AMD EPYC, where 1e-6 had held elsewhere; a routing or
weight read wrong moves them by 1e-2 or more), the router's
gradient atol 1e-5 (its entries reach 40: the round-off of sums of terms that large); logits
rtol and atol 1e-5 (order 1); losses rel 1e-5 and SGD weights rtol 1e-5, atol 1e-6
(``assert_matches_serial``), as in ``test_hf_moe_families.py``; Qwen4-Exp's weights atol 1e-5
(its layers amplify round-off: measured beside `ATOL`).
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
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.families.hf_moe import (
    convert_hf_moe,
    hf_moe_state_dict,
    is_hf_sparse_moe,
    moe_from_hf,
)
from tessera.launcher.families.hf_moe_routing import read_layout
from tessera.launcher.families.spec import model_spec, refusals
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
# the router's gradient: entries up to ~40 here, each a sum over the tokens of terms that large, so
# that its small entries carry the round-off of the large terms (measured 3e-6 on 0.08)
close_router = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)
close_logits = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)
VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 4, 3, 0.2
FAMILIES = ["kolibri1_1", "qwen4_exp_text", "dots3_note_text"]


def _build(family: str) -> Any:
    model: Any = tiny_moe_model(family)
    model.config.use_cache = False
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
    close_router(layer.router.weight.grad, block.get_parameter(layout.router_weight).grad)
    gate_up, down = block.experts.gate_up_proj.grad, block.experts.down_proj.grad
    h = gate_up.shape[1] // 2
    assert layer.experts.w3 is not None
    close(layer.experts.w1.grad, gate_up[:, :h].transpose(1, 2))
    close(layer.experts.w3.grad, gate_up[:, h:].transpose(1, 2))
    close(layer.experts.w2.grad, down.transpose(1, 2))
    assert layout.shared is not None and layer.shared is not None  # each of them has one
    shared = block.get_submodule(layout.shared)
    assert layer.shared.w2.grad is not None
    close(layer.shared.w2.grad[0], shared.down_proj.weight.grad.t())
    if layout.shared_gate is not None:  # Qwen4-Exp's
        assert layer.shared_gate is not None and layer.shared_gate.grad is not None
        close(layer.shared_gate.grad, block.get_parameter(f"{layout.shared_gate}.weight").grad)


def test_each_is_read_by_the_kind_its_forward_copies() -> None:
    """What the conversion above rests on: Kolibri 1.1's router is Kolibri's (chosen by logits +
    bias), Qwen4-Exp's block Qwen2-MoE's (sigmoid-gated shared expert), dots3 Note's router
    DeepSeek-V3's with 2 of 4 groups kept."""
    layouts = {f: read_layout(sparse_blocks(_build(f))[0]) for f in FAMILIES}
    assert layouts["kolibri1_1"].routing.choose_by == "logits" and layouts["kolibri1_1"].score_bias
    assert layouts["qwen4_exp_text"].shared_gate == "shared_expert_gate"
    dots = layouts["dots3_note_text"].routing
    assert (dots.score, dots.groups, dots.top_groups, dots.choice_bias) == ("sigmoid", 4, 2, True)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_model_is_transformers_model_both_ways(family: str) -> None:
    """Converted, it gives transformers' logits; its weights mapped back load strictly into a fresh
    model that then gives its logits; ``boost()``'s export parts are transformers' tensors
    (``tessera.launcher.testing_hf_moe``'s checks)."""
    assert_converts_with_the_same_logits(_build(family))
    assert_weights_load_back(lambda: _build(family))
    assert_export_parts_are_transformers_tensors(_build(family))


def test_doges_mixture_has_no_expert_bank_and_mixes_rows() -> None:
    """Doge's ``DogeCDMoE`` (``is_moe``) is no sparse block: its experts are single rows of two
    embeddings chosen by product keys, and its router's ``view(2, tokens, -1)`` takes a token's
    two key halves from the logits of two other tokens, one of another row: changing row 1
    changes row 0's output, which no per-token router (nor a split of the batch) reproduces."""
    model: Any = tiny_moe_model("doge")
    mlp = model.model.layers[0].mlp
    assert type(mlp).__name__ == "DogeCDMoE" and not sparse_blocks(model) and not is_hf_sparse_moe(mlp)
    assert convert_hf_moe(copy.deepcopy(model)) == 0
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1))
    other = x.clone()
    other[1] += 1.0
    with torch.no_grad():
        want, got = mlp(x)[0][0], mlp(other)[0][0]
        alone = mlp(x[:1])[0][0]  # row 0 alone, as a dp rank holding it would see it
    assert not torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(alone, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "parallel",
    [ParallelConfig(), ParallelConfig(dp=2, microbatches=1), ParallelConfig(cp=2, microbatches=1)],
    ids=["microbatches4", "dp2", "cp2"],
)
def test_doges_mixture_is_refused_wherever_the_batch_is_split(parallel: ParallelConfig) -> None:
    """``boost()`` refuses Doge's mixture in step 1 (no process group is needed) whenever a forward
    sees part of the step's batch: 4 microbatches (the default), dp=2, cp=2; Doge without its
    mixture is not refused so."""
    model: Any = tiny_moe_model("doge")
    config = _boost_config(parallel, 1)
    with pytest.raises(ValueError, match=r"cannot take batch: its mixture \(is_moe\) routes each token"):
        boost(model, torch.optim.SGD(model.parameters(), lr=LR), config)
    dense: Any = tiny_moe_model("doge", {"is_moe": False})
    assert not refusals(dense, model_spec(dense), ["batch"])
    assert refusals(model, model_spec(model), ["batch"])


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
    losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
    weights = engine.full_state_dict()  # each expert bank gathered over the ep group
    engine.mesh.close()
    return losses, weights


def _boost_config(parallel: ParallelConfig, zero: int) -> Config:
    """``parallel`` at ZeRO stage ``zero``, comparable with `serial_run`: fp32, no clipping."""
    c = Config(parallel=parallel, zero=ZeroConfig(stage=zero), train=TrainConfig(precision=Precision.FP32))
    return dataclasses.replace(c, optim=dataclasses.replace(c.optim, clip_grad_norm=0.0))


MODES = {
    "ep2-zero1": (ParallelConfig(dp=2, ep=2, microbatches=1), 1),
    "ep2-zero3": (ParallelConfig(dp=2, ep=2, microbatches=1), 3),
    "tp2": (ParallelConfig(tp=2, microbatches=1), 1),
    "pp2": (ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1),
}
CASES = [(f, m) for f in FAMILIES for m in MODES]
# Qwen4-Exp's weights after 3 steps move by round-off its layers amplify (the gated delta rule's
# reference chunked form, 4 hyper-connected streams): in one process, its batch run in two halves
# ends 1.5e-6 from it run whole (linear_attn.conv1d.weight), and its fp32 run 5e-5 from fp64; a
# lost contribution or a wrong shard is off by an update (lr 0.2 x gradients of order 1e-2)
ATOL = {"qwen4_exp_text": 1e-5}


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_a_converted_family_trains_as_serially(worker_pools: PoolFactory, family: str, mode: str) -> None:
    """dp=2 x ep=2 (each rank routes its own tokens; ZeRO-3 shards each expert bank over edp);
    tp=2 with no plan (the roles ``boost()`` derives: each mixture ``moe``; Kolibri 1.1's
    attention kept whole, as its indexer chooses keys from its own heads); pp=2 (1F1B, 2
    microbatches) over the decoder blocks ``boost()`` finds (Qwen4-Exp's embedding copied into its
    4 hyper-connected streams, its indexer given a row of positions per sequence)."""
    config = _boost_config(*MODES[mode])
    results = worker_pools(config.world_size).run(_parallel, config, family, timeout=180)
    assert_matches_serial(results, _serial(family), atol=ATOL.get(family, 1e-6))


def _boosted(rank: int, config: Config, family: str) -> Run:
    """One rank's run, its weights under transformers' names (``hf_moe_state_dict``)."""
    model: nn.Module = _build(family)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config)
    losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
    weights = hf_moe_state_dict(engine.full_state_dict(), like=_build(family))
    engine.mesh.close()
    return losses, weights


@pytest.mark.parametrize("mode", ["dp2", "tp2"])
def test_gemma4_converted_by_boost_trains_as_its_hf_model(worker_pools: PoolFactory, mode: str) -> None:
    """``boost()`` converts Gemma 4's mixtures inside its decoder layers itself
    (``families.hf_gemma4``): it then trains at dp=2 and at tp=2 with derived roles (each
    mixture split inside over tp, its attention and dense MLP split) as the unconverted HF model
    does serially."""
    parallel = ParallelConfig(dp=2, microbatches=1) if mode == "dp2" else ParallelConfig(tp=2, microbatches=1)
    config = _boost_config(parallel, 1)
    results = worker_pools(config.world_size).run(_boosted, config, "gemma4_text", timeout=180)
    assert_matches_serial(results, serial_run(_build("gemma4_text"), TOKENS.first(STEPS), sgd(LR)))
