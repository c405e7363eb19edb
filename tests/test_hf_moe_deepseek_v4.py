"""DeepSeek-V4's sparse MoE block as a `tessera.moe.MoE`: its first ``hash_moe`` layers read each
token's experts from a fixed table ``gate.tid2eid [vocab, k]`` at its token id (which its decoder
layers pass to every block as ``input_ids``) and weigh them by ``sqrt(softplus(logit))`` scores,
renormalised and scaled (`tessera.moe.hash_routing`, the router's ``tid2eid``); its other layers
choose by those scores plus ``e_score_correction_bias``; its experts and shared expert clamp gate
(max) and up (both sides) before ``silu(gate) * up``. The model is
``testing_hf_moe.tiny_moe_model("deepseek_v4")`` (a hash layer, then a top-k one; swiglu_limit 1,
which its clamps reach), its tables filled here with a seeded draw of distinct experts per id (HF
initialises them to zeros: every token to expert 0).

Tier 0: each converted block computes HF's block's outputs and every gradient (each converted
parameter's gradient assembled from the HF tensors' gradients through the export parts); each
detail matters (the ids, the table, the score function, the clamps); the converted model gives
HF's logits, its weights and tables mapped back to transformers' names load strictly into a
fresh model that then gives its logits, and the export parts of ``boost()`` (the table too, a
persistent buffer) are transformers' tensors.

Tier 2 (the worker pool): trained through ``boost()`` at dp=2 x ep=2 with ZeRO-1 and ZeRO-3 it
gives the serial run's losses and weights (3 SGD steps, momentum 0.9), and with no plan written
at tp=2 (the mixtures split inside); ``boost()`` converting the HF model itself gives the HF
model's serial run. Pipeline parallelism (the token ids carried from the first stage to the hash
layers, ``families/hf_beside.py``) is held to its serial run in ``test_hf_pp_gemma4_dsv4.py``.

Tolerances: block outputs and gradients fp32 rtol 1e-5, atol 1e-5 (the same products, HF's
per-expert loop against one batched matmul; outputs of order 1); a detail read wrong moves
outputs by far more (`test_each_detail_decides_the_output`); logits rtol and atol 1e-5 (order 1);
losses rel 1e-5 and SGD weights rtol 1e-5, atol 1e-6 (`assert_matches_serial`).
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
from tessera.launcher.families.hf_moe import convert_hf_moe, hf_moe_conversion, hf_moe_state_dict
from tessera.launcher.families.hf_moe_banks import bank_key
from tessera.launcher.families.hf_moe_kinds import source_key
from tessera.launcher.families.hf_moe_routing import read_layout
from tessera.launcher.testing import RandomTokens, assert_matches_serial, oracle_config, serial_run, sgd
from tessera.launcher.testing_hf_moe import (
    assert_converts_with_the_same_logits,
    assert_export_parts_are_transformers_tensors,
    assert_weights_load_back,
    sparse_blocks,
    tiny_moe_model,
)
from tessera.moe import MoE, SwiGLUVariant

transformers = pytest.importorskip("transformers", reason="transformers is not installed: HF MoE NOT tested")

close_out = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)  # block outputs (docstring)
close_grad = partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)  # block gradients
SEQ, BATCH, STEPS, LR, VOCAB = 8, 4, 3, 0.2, 64


def _build() -> Any:
    """The tiny model, each hash router's table a seeded draw of distinct experts per token id."""
    model: Any = tiny_moe_model("deepseek_v4")
    model.config.use_cache = False
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for block in sparse_blocks(model):
            table = getattr(block.gate, "tid2eid", None)
            if table is not None:
                experts = block.gate.num_experts
                table.copy_(
                    torch.stack([torch.randperm(experts, generator=gen)[: table.shape[1]] for _ in table])
                )
    return model


def _inputs() -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 32, generator=gen)
    return x, torch.randint(0, VOCAB, (3, 5), generator=gen), torch.randn(3, 5, 32, generator=gen)


# ---------------------------------------------------------------------------- tier 0
@pytest.mark.parametrize("index", [0, 1], ids=["hash", "top-k"])
def test_a_converted_block_computes_what_hf_computes(index: int) -> None:
    """Outputs, the input gradient, and every converted parameter's gradient against the HF
    tensors' it is made of; both given the token ids as the decoder layer passes them."""
    model = _build()
    block = sparse_blocks(model)[index]
    name = next(n for n, m in model.named_modules() if m is block)
    converted = copy.deepcopy(model)
    exported = hf_moe_conversion(converted).exported
    layer = converted.get_submodule(name)
    assert isinstance(layer, MoE) and (layer.router.tid2eid is not None) == (index == 0)
    x, ids, g = _inputs()
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = block(x_hf, input_ids=ids), layer(x_ours, input_ids=ids)
    close_out(got, want)
    (want * g).sum().backward()
    (got * g).sum().backward()
    close_grad(x_ours.grad, x_hf.grad)
    for rel, p in layer.named_parameters():
        parts = parts_of(f"{name}.{rel}", exported)
        hf_grad = assemble(parts, [model.get_parameter(part.name).grad for part in parts])
        close_grad(p.grad, hf_grad, msg=lambda m, rel=rel: f"{rel}: {m}")


def test_each_detail_decides_the_output() -> None:
    """Read without its detail the hash block computes something else on these inputs (so the
    test above could fail): other ids, the table's rows shifted, sigmoid scores for sqrt(softplus),
    the clamps left out."""
    block: Any = sparse_blocks(_build())[0]
    x, ids, _ = _inputs()
    converted = copy.deepcopy(_build())
    convert_hf_moe(converted)
    layer: Any = converted.model.layers[0].mlp  # the hash layer
    assert isinstance(layer, MoE)
    with torch.no_grad():
        want = block(x, input_ids=ids)
        close_out(layer(x, input_ids=ids), want)
        assert not torch.allclose(layer(x, input_ids=(ids + 1) % VOCAB), want, rtol=1e-3, atol=1e-3)
        for detail in ("table", "score", "clamps"):
            changed = copy.deepcopy(layer)
            if detail == "table":
                changed.router.tid2eid.copy_(changed.router.tid2eid.roll(1, dims=0))
            elif detail == "score":
                changed.router.spec = type(changed.router.spec)(
                    score="sigmoid", scale=changed.router.spec.scale
                )
            else:
                changed.experts.activation = "swiglu"
                assert changed.shared is not None
                changed.shared.activation = "swiglu"
            assert not torch.allclose(changed(x, input_ids=ids), want, rtol=1e-3, atol=1e-3), detail


def test_what_is_read() -> None:
    hashed, chosen = (read_layout(b) for b in sparse_blocks(_build()))
    assert hashed.hash_table == "gate.tid2eid" and hashed.score_bias is None
    assert chosen.hash_table is None and chosen.score_bias == "gate.e_score_correction_bias"
    for layout in (hashed, chosen):
        assert layout.routing.score == "sqrtsoftplus" and layout.routing.scale == 1.5 and layout.renormalize
        assert layout.activation == SwiGLUVariant(gate_limit=1.0, up_limit=1.0)
        assert layout.shared_activation == layout.activation and layout.shared == "shared_experts"
    assert not hashed.routing.choice_bias and chosen.routing.choice_bias


KEYS = [
    ("deepseek_v4.DeepseekV4Experts", "51563666960dd0ee+f7dbc36f891706f9"),
    ("deepseek_v4.DeepseekV4MLP", "2e8c7fb2f8e54934"),
]


@pytest.mark.parametrize(("like", "key"), KEYS, ids=[like for like, _ in KEYS])
def test_each_part_read_here_still_reads_the_forward_it_was_written_for(like: str, key: str) -> None:
    """The bank's and shared expert's keys (the block's and routers' are held by
    ``tests/test_hf_moe_families.py``): a new transformers changing one is refused, not misread."""
    model, cls = like.split(".")
    found = getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), cls)
    assert (bank_key(found) if "Experts" in cls else source_key(found.forward)) == key


def test_a_converted_model_is_transformers_model_both_ways() -> None:
    """Converted, it gives transformers' logits; its weights mapped back load strictly into a fresh
    model that then gives its logits; ``boost()``'s export parts are transformers' tensors
    (``tessera.launcher.testing_hf_moe``'s checks)."""
    assert_converts_with_the_same_logits(_build())
    assert_weights_load_back(_build)
    assert_export_parts_are_transformers_tensors(_build())


def test_the_table_goes_back_to_transformers_name() -> None:
    """A converted table changed is what a fresh model loads as ``gate.tid2eid``."""
    converted = _build()
    convert_hf_moe(converted)
    state = converted.state_dict()
    key = next(k for k in state if k.endswith("router.tid2eid"))
    state[key] = state[key].roll(3, dims=0)
    fresh = _build()
    fresh.load_state_dict(hf_moe_state_dict(state, like=fresh), strict=True)
    assert torch.equal(fresh.get_buffer(key.replace("router.tid2eid", "gate.tid2eid")), state[key])


def test_a_hash_layer_without_the_ids_is_refused() -> None:
    converted = _build()
    convert_hf_moe(converted)
    x, _, _ = _inputs()
    with pytest.raises(ValueError, match="call it with input_ids"):
        converted.model.layers[0].mlp(x)


# ---------------------------------------------------------------------------- tier 2
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)
Run = tuple[list[float], dict[str, Tensor]]


def _converted() -> nn.Module:
    model: nn.Module = _build()
    convert_hf_moe(model)
    return model


def _parallel(rank: int, config: Config, convert: bool = True) -> tuple[Run, list[int]]:
    """One rank's run, and over how many tp ranks each of its mixtures splits its experts;
    ``convert=False``: ``boost()`` converts the blocks itself (keeping transformers' names)."""
    model = _converted() if convert else _build()
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config)
    try:
        losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
        weights = engine.full_state_dict()  # each expert bank gathered over ep
    finally:
        engine.mesh.close()
    return (losses, weights), [m.tp for m in model.modules() if isinstance(m, MoE)]


@pytest.mark.parametrize("zero", [1, 3])
def test_a_converted_model_trains_at_ep2_as_serially(worker_pools: PoolFactory, zero: int) -> None:
    """dp=2 x ep=2: the router, its table and the shared expert replicated, each rank routing its
    own tokens by their own ids."""
    config = oracle_config(ParallelConfig(dp=2, ep=2, microbatches=1), zero, batch_size=BATCH)
    results = worker_pools(config.world_size).run(_parallel, config, timeout=180)
    assert all(splits == [1, 1] for _, splits in results), results[0][1]
    assert_matches_serial([run for run, _ in results], serial_run(_converted(), TOKENS.first(STEPS), sgd(LR)))


def test_boost_converts_it_itself_and_trains_at_ep2_as_transformers_serially(
    worker_pools: PoolFactory,
) -> None:
    """Unconverted, ``boost()`` converts the blocks (the table read from ``gate.tid2eid``) and at
    dp=2 x ep=2 gives the serial run of the HF model itself: its losses, and its weights once the
    converted ones are mapped back to transformers' names (``hf_moe_state_dict``)."""
    config = oracle_config(ParallelConfig(dp=2, ep=2, microbatches=1), 1, batch_size=BATCH)
    results = worker_pools(config.world_size).run(_parallel, config, False, timeout=180)
    assert all(splits == [1, 1] for _, splits in results), results[0][1]
    runs = [(losses, hf_moe_state_dict(weights, like=_build())) for (losses, weights), _ in results]
    assert_matches_serial(runs, serial_run(_build(), TOKENS.first(STEPS), sgd(LR)))


def test_a_converted_model_trains_with_no_plan_at_tp2(worker_pools: PoolFactory) -> None:
    """No plan written: at tp=2 the roles ``boost()`` derives (both mixtures split inside over tp,
    with no sequence parallelism: every tp rank routes the same whole tokens by the same ids)."""
    config = oracle_config(ParallelConfig(tp=2, microbatches=1), 1, batch_size=BATCH)
    results = worker_pools(config.world_size).run(_parallel, config, timeout=180)
    assert all(splits == [2, 2] for _, splits in results), results[0][1]  # split inside over tp
    assert_matches_serial([run for run, _ in results], serial_run(_converted(), TOKENS.first(STEPS), sgd(LR)))
