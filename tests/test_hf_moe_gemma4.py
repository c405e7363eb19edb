"""Gemma 4's mixture of experts (``gemma4_text`` with ``enable_moe_block``), which sits inside its
decoder layer, converted into one ``tessera.moe.MoE`` the layer holds as ``moe``
(``tessera.launcher.families.hf_gemma4``): the router reading the residual through a weightless
RMS norm times ``router.scale`` and ``hidden_size**-0.5``, each chosen weight times
``router.per_expert_scale``, the experts reading ``pre_feedforward_layernorm_2`` of the residual
through the tanh-GELU gate, their sum through ``post_feedforward_layernorm_2``. The model is
``testing_hf_moe.tiny_moe_model``'s (2 layers, 8 experts top-2, every weight drawn at std 0.3,
so the scales and norms are far from their ones).

Tier 0: the converted model gives transformers' logits, and every converted parameter's
gradient is the one assembled from the HF model's gradients through the export parts; its
weights, mapped back to transformers' names, load strictly into a fresh model that then gives its
logits; ``boost()``'s export parts are transformers' tensors; the layer, router and norm forwards
the conversion was written for still hash to their keys; a layer of another forward is refused.

Tier 2 (the worker pool): trained through ``boost()`` (3 SGD steps, momentum 0.9), at dp=2 x ep=2
with ZeRO-1 and ZeRO-3, and at tp=2 with no plan (the roles ``boost()`` derives: the mixture
split inside over tp), and at tp=2 with sequence parallelism for a config without per-layer
inputs (``hidden_size_per_layer_input=0``), it gives the serial run's losses and weights. With
per-layer inputs, tp=2 with sequence parallelism fails in training (each rank's slice of the
sequence times the whole sequence's per-layer input, in the layer's own per-layer step, not the
mixture), though the derived plan says it takes sequence parallelism. Pipeline parallelism
(the per-layer inputs and the shared keys and values carried from the first stage,
``families/hf_beside.py``) is held to its serial run in ``test_hf_pp_gemma4_dsv4.py``.

Tolerances: logits rtol and atol 1e-5 (order 1, the same products summed in another order);
gradients rtol 1e-5, atol 1e-5 (HF's per-expert loop against one batched matmul, through two
layers of norms); losses rel 1e-5 and SGD weights rtol 1e-5, atol 1e-6 (`assert_matches_serial`),
as for the other families.
"""

from __future__ import annotations

import copy
import importlib
from functools import partial
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, boost
from tessera.launcher.checkpoint.exported import assemble, parts_of
from tessera.launcher.families.hf_gemma4 import LAYER, NORM, ROUTER, is_layer_mixture, layer_mixture
from tessera.launcher.families.hf_moe import convert_hf_moe, hf_moe_conversion
from tessera.launcher.families.hf_moe_kinds import source_key
from tessera.launcher.testing import RandomTokens, assert_matches_serial, oracle_config, serial_run, sgd
from tessera.launcher.testing_hf_moe import (
    assert_converts_with_the_same_logits,
    assert_export_parts_are_transformers_tensors,
    assert_weights_load_back,
    sparse_blocks,
    tiny_moe_model,
    token_ids,
)
from tessera.moe import MoE

transformers = pytest.importorskip("transformers", reason="transformers is not installed: HF MoE NOT tested")

close_grad = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)
SEQ, BATCH, STEPS, LR = 8, 4, 3, 0.2
NO_PER_LAYER = {"hidden_size_per_layer_input": 0}


def _build(changes: dict[str, Any] | None = None) -> Any:
    model: Any = tiny_moe_model("gemma4_text", changes)
    model.config.use_cache = False
    return model


# ---------------------------------------------------------------------------- tier 0
def test_the_converted_model_computes_transformers_logits_and_gradients() -> None:
    """Each decoder layer holds its mixture as ``moe`` (router, experts and the two norms gone);
    the logits and every converted parameter's gradient (the router's scales and the norms
    included) match transformers' through the export parts."""
    model = _build()
    converted = copy.deepcopy(model)
    exported = hf_moe_conversion(converted).exported
    layers = [m for m in converted.modules() if isinstance(m, MoE)]
    assert len(layers) == 2 and not sparse_blocks(converted)
    held = converted.model.layers[0]
    assert isinstance(held.moe, MoE) and not hasattr(held, "router") and not hasattr(held, "experts")
    ids = token_ids(3)
    want, got = model(ids, labels=ids), converted(ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    want.loss.backward()
    got.loss.backward()
    checked = 0
    for name, p in converted.named_parameters():
        parts = parts_of(name, exported)
        hf_grad = assemble(parts, [model.get_parameter(part.name).grad for part in parts])
        close_grad(p.grad, hf_grad)
        checked += ".moe." in name
    assert checked == 2 * 8  # every tensor of both mixtures


def test_the_converted_model_is_transformers_model_both_ways() -> None:
    """``tessera.launcher.testing_hf_moe``'s checks: logits, weights mapped back and loaded
    strictly into a fresh model, export parts assembled from transformers' tensors."""
    assert_converts_with_the_same_logits(_build())
    assert_weights_load_back(_build)
    assert_export_parts_are_transformers_tensors(_build())


def test_the_mixture_alone_computes_the_layers_mixture() -> None:
    """``layer_mixture`` against transformers' own modules of one layer, on a residual of order 1:
    ``post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(r), router(r)))``."""
    layer: Any = _build().model.layers[1]
    moe = layer_mixture(layer)
    r = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        flat = r.reshape(-1, 32)
        _, weights, index = layer.router(flat)
        mixed = layer.experts(layer.pre_feedforward_layernorm_2(flat), index, weights)
        want = layer.post_feedforward_layernorm_2(mixed.reshape(r.shape))
        torch.testing.assert_close(moe(r), want, rtol=1e-5, atol=1e-6)
        assert moe.experts.activation == "geglu_tanh"
        moe.experts.activation = "swiglu"  # the activation decides: SiLU's gate is another function
        assert (moe(r) - want).abs().max() > 1e-3


@pytest.mark.parametrize(("like", "key"), [LAYER, ROUTER, NORM], ids=[LAYER[0], ROUTER[0], NORM[0]])
def test_each_forward_read_here_still_hashes_to_its_key(like: str, key: str) -> None:
    model, cls = like.split(".")
    found = getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), cls)
    assert source_key(found.forward) == key


def test_a_layer_of_another_forward_is_not_converted_as_gemma4s() -> None:
    """A decoder layer whose forward differs (a new transformers) is not recognised: it is read
    as a block and refused, naming its source key, changing nothing."""
    model = _build()
    layer = model.model.layers[0]

    class Changed(type(layer)):  # type: ignore[misc]
        def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            return super().forward(hidden_states, *args, **kwargs) * 1.0

    layer.__class__ = Changed
    assert not is_layer_mixture(layer) and is_layer_mixture(model.model.layers[1])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError,
        match=r"layers\.0: Changed: its block Changed has a forward tessera.moe has no reading of \(source",
    ):
        convert_hf_moe(model)
    assert not any(isinstance(m, MoE) for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_peft_adapters_count_only_on_the_mixture() -> None:
    """LoRA on the attention of a Gemma 4 layer does not stop its mixture converting (the
    logits stay the PEFT model's); LoRA on the mixture's router is refused by both entry points,
    changing nothing, as no conversion carries it."""
    peft = pytest.importorskip("peft", reason="peft is not installed: Gemma 4 with PEFT NOT tested")
    lora = partial(peft.LoraConfig, r=2, init_lora_weights=False)
    model = peft.get_peft_model(_build(), lora(target_modules=["q_proj", "v_proj"]))
    converted = copy.deepcopy(model)
    assert hf_moe_conversion(converted).blocks == [f"base_model.model.model.layers.{i}.moe" for i in (0, 1)]
    ids = token_ids(3)
    torch.testing.assert_close(converted(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    on_router = peft.get_peft_model(_build(), lora(target_modules=["proj"]))
    with pytest.raises(ValueError, match=r"layers\.0 \(Gemma4TextDecoderLayer\) carries PEFT .* not carried"):
        hf_moe_conversion(on_router)
    with pytest.raises(ValueError, match=r"PEFT adapters on a decoder layer's mixture are not carried"):
        convert_hf_moe(on_router)
    assert not any(isinstance(m, MoE) for m in on_router.modules())


# ---------------------------------------------------------------------------- tier 2
TOKENS = RandomTokens(vocab=64, batch=BATCH, seq=SEQ)
Run = tuple[list[float], dict[str, Tensor]]


def _converted(changes: dict[str, Any] | None = None) -> nn.Module:
    model: nn.Module = _build(changes)
    convert_hf_moe(model)
    return model


def _parallel(rank: int, config: Config, changes: dict[str, Any] | None) -> tuple[Run, list[int]]:
    """One rank's run of the unconverted model (``boost()`` converts its mixtures itself), and over
    how many tp ranks each of its mixtures splits its experts."""
    model: nn.Module = _build(changes)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config)
    try:
        losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
        weights = engine.full_state_dict()  # each expert bank gathered over ep
    finally:
        engine.mesh.close()
    return (losses, weights), [m.tp for m in model.modules() if isinstance(m, MoE)]


MODES = {
    "ep2-zero1": (ParallelConfig(dp=2, ep=2, microbatches=1), 1, 1, None),
    "ep2-zero3": (ParallelConfig(dp=2, ep=2, microbatches=1), 3, 1, None),
    "tp2": (ParallelConfig(tp=2, microbatches=1), 1, 2, None),
    "tp2-sp": (ParallelConfig(tp=2, sequence_parallel=True, microbatches=1), 1, 2, NO_PER_LAYER),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_gemma4_trains_as_serially(worker_pools: PoolFactory, mode: str) -> None:
    """Given the HF model, ``boost()`` converts its mixtures (`hf_moe_conversion`), each trained
    tensor in its HF tensor's optimizer group; the serial run is of the model converted by hand.
    dp=2 x ep=2 (each rank routes its own tokens; ZeRO-3 shards each bank over edp); tp=2 with
    no plan (each mixture split inside over tp: its router, scales and norms whole on every rank
    with partial gradients summed over tp; attention and dense MLP by their derived roles); the
    same with sequence parallelism, without per-layer inputs (module docstring)."""
    parallel, zero, split, changes = MODES[mode]
    config = oracle_config(parallel, zero, batch_size=BATCH)
    results = worker_pools(config.world_size).run(_parallel, config, changes, timeout=180)
    assert all(set(splits) == {split} for _, splits in results), results[0][1]
    serial = serial_run(_converted(changes), TOKENS.first(STEPS), sgd(LR))
    assert_matches_serial([run for run, _ in results], serial)


def test_sequence_parallelism_is_refused_where_layers_take_per_layer_inputs() -> None:
    """Gemma 4's per-layer inputs cover the whole sequence, which sequence parallelism splits in
    the hidden states: refused before any process group, naming them (it failed inside the layer
    on a size mismatch); the same model without them takes it (``tp2-sp`` above)."""
    model = _build()
    config = Config(parallel=ParallelConfig(tp=2, sequence_parallel=True, microbatches=1))
    with pytest.raises(ValueError, match=r"sequence_parallel: its layers take per-layer inputs .*=4"):
        boost(model, torch.optim.SGD(model.parameters(), lr=LR), config)


def test_the_loss_reads_the_mixture() -> None:
    """The tier-2 runs could not pass with the mixture left out: the converted model's loss
    changes when each mixture's output is zeroed (its post-norm weight set to 0)."""
    model: Any = _converted()
    ids = token_ids(2)
    with torch.no_grad():
        want = model(ids, labels=ids).loss
        for m in model.modules():
            if isinstance(m, MoE):
                assert m.post_norm is not None
                m.post_norm.zero_()
        assert abs(float(model(ids, labels=ids).loss - want)) > 1e-3
