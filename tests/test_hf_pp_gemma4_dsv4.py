"""Gemma 4 and DeepSeek-V4 cut into pipeline stages (``hf.decoder_blocks``): what their layers take
from the model's inputs beside the hidden states is made by the first stage and carried through
the others in the stage's one activation (``tessera.launcher.families.hf_beside``).

Gemma 4 (``gemma4_text`` with ``enable_moe_block``, its mixtures converted) hands each layer its
slice of the per-layer inputs (made from the token ids and the embeddings' output by the model's
``get_per_layer_inputs`` and ``project_per_layer_inputs``, whose modules the first block holds),
and a dict of keys and values (``shared_kv_states``) that a ``store`` layer fills and a later
``reuse`` layer reads instead of its own (its config's ``num_kv_shared_layers``). The tiny model
of ``tiny_moe_model`` (2 layers, sliding then full, per-layer inputs of width 4) shares nothing;
the variant ``gemma4-shared`` has two full-attention layers, layer 1 reusing layer 0's keys and
values (it has no key or value projection: keys or values lost or replaced change what it
computes or fail); ``gemma4-shared3`` has 3 layers (full, sliding with a window of 4 of the 8
tokens, full), layer 2 reusing layer 0's keys and values, which layer 1 hands on; ``gemma4-no-per-layer``
has no per-layer inputs.

DeepSeek-V4 (``deepseek_v4``, 4 stacked residual streams) routes its ``hash_moe`` layers by token
id (``tid2eid``, filled here with a seeded draw of distinct experts per id: HF's zeros send every
token to expert 0, which no id would change), so the ids travel with the hidden states; its
layers' kinds (heavily compressed, compressed sparse attention) have no rotary of their own and
are given the model's by rope type (``{"main", "compress"}``). The tiny model has a hash layer,
then a top-k one; the variant ``deepseek_v4-hash2`` routes both layers by hash (so the second
stage's layer reads the ids that crossed).

Tier 0: the blocks chained in one process give the model's logits (``check_blocks``: eval mode,
to 1e-5 of their largest magnitude, as ``boost()`` checks them); the variants have what they are
for; what the first stage carries is read from each model (the ids, the per-layer inputs, the
layer types whose keys and values a later layer reads); keys and values of another dtype than the
hidden states (which would travel without their gradient) are refused naming them.

Tier 2 (the worker pool): ``gemma4-shared`` and ``deepseek_v4-hash2`` trained through ``boost()``
with no plan (3 SGD steps, momentum 0.9, fp32, no clipping) at pp=2 with 1F1B (2 microbatches)
and interleaved 1F1B (2 stages per rank, 4 microbatches), layer 1 on a later stage than layer 0
(so the per-layer inputs, the shared keys and values with their gradients, and the token ids
cross the stages), equal their serial runs by ``assert_matches_serial``'s bounds: losses rel 1e-5
(microbatches sum the mean's terms in another order: a few ulps), weights rtol 1e-5, atol 1e-6
(SGD is linear in the gradient, so they stay at round-off).
"""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.families.hf import decoder_blocks
from tessera.launcher.families.hf_beside import Beside
from tessera.launcher.families.hf_moe import convert_hf_moe
from tessera.launcher.families.spec import check_blocks, logits_of
from tessera.launcher.testing import RandomTokens, assert_matches_serial, serial_run, sgd
from tessera.launcher.testing_hf_moe import sparse_blocks, tiny_moe_model, token_ids

pytest.importorskip("transformers", reason="transformers is not installed: HF pipeline blocks NOT tested")

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 4, 3, 0.2
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)
_FULL = ["full_attention", "full_attention"]
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma4_text": ("gemma4_text", {}),
    "gemma4-shared": ("gemma4_text", {"layer_types": _FULL, "num_kv_shared_layers": 1}),
    "gemma4-shared3": (
        "gemma4_text",
        {"num_hidden_layers": 3, "layer_types": ["full_attention", "sliding_attention", "full_attention"]}
        | {"num_kv_shared_layers": 1, "sliding_window": 4},
    ),
    "gemma4-no-per-layer": ("gemma4_text", {"hidden_size_per_layer_input": 0}),
    "deepseek_v4": ("deepseek_v4", {}),
    "deepseek_v4-hash2": ("deepseek_v4", {"mlp_layer_types": ["hash_moe", "hash_moe"], "swiglu_limit": 1.0}),
}


def _hf(case: str) -> Any:
    """The case's tiny HF model, no cache; DeepSeek-V4's hash tables a seeded draw of distinct
    experts per token id."""
    family, changes = CASES[case]
    model: Any = tiny_moe_model(family, changes or None)
    model.config.use_cache = False
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for block in sparse_blocks(model):
            table = getattr(getattr(block, "gate", None), "tid2eid", None)
            if table is not None:
                experts = block.gate.num_experts
                table.copy_(
                    torch.stack([torch.randperm(experts, generator=gen)[: table.shape[1]] for _ in table])
                )
    return model


def _model(case: str) -> Any:
    """The case's model, its mixtures converted as ``boost()`` converts them."""
    model = _hf(case)
    convert_hf_moe(model)
    return model


# ---------------------------------------------------------------------------- tier 0
@pytest.mark.parametrize("case", CASES)
def test_the_blocks_chained_give_the_models_logits(case: str) -> None:
    model = _model(case)
    blocks = decoder_blocks(model)
    assert len(blocks) == 2 + model.config.num_hidden_layers, [type(b).__name__ for b in blocks]
    check_blocks(model, blocks, token_ids(1), logits_of)


def test_the_variants_have_what_they_are_for() -> None:
    """``gemma4-shared``'s layer 1 reads layer 0's keys and values (it has none of its own) and
    every layer takes per-layer inputs; both layers of ``deepseek_v4-hash2`` route by token id,
    through tables that send different ids to different experts."""
    gemma = _model("gemma4-shared")
    attention = [layer.self_attn for layer in gemma.model.layers]
    assert attention[0].store_full_length_kv and attention[1].is_kv_shared_layer
    assert not hasattr(attention[1], "k_proj") and gemma.config.hidden_size_per_layer_input > 0
    deepseek = _hf("deepseek_v4-hash2")
    gates = [layer.mlp.gate for layer in deepseek.model.layers]
    assert all(hasattr(g, "tid2eid") for g in gates)
    assert all(len({tuple(row.tolist()) for row in g.tid2eid}) > 1 for g in gates)


def test_what_the_first_stage_carries_is_read_from_each_model() -> None:
    carried = {case: decoder_blocks(_model(case))[1].beside for case in CASES}  # type: ignore[union-attr]
    full = frozenset({"full_attention"})
    assert carried["gemma4-shared"] == Beside(False, True, True, ("full_attention",), (full, frozenset()))
    assert carried["gemma4-shared3"].kv_read_after == (full, full, frozenset())  # layer 1 hands them on
    none = (frozenset(), frozenset())
    assert carried["gemma4_text"] == Beside(False, True, True, (), none)  # both layers store: none read
    assert carried["gemma4-no-per-layer"] == Beside(False, False, True, (), none)
    assert carried["deepseek_v4"] == carried["deepseek_v4-hash2"] == Beside(ids=True)
    assert carried["gemma4-shared"].names() == (
        "per_layer_inputs",
        "shared_kv_states[full_attention] keys",
        "shared_kv_states[full_attention] values",
    )


def test_keys_and_values_of_another_dtype_are_refused_naming_them() -> None:
    """They would travel as bytes, without their gradient: refused, naming them."""
    beside = Beside(
        shares_kv=True, kv_types=("full_attention",), kv_read_after=(frozenset({"full_attention"}),)
    )
    hidden, keys = torch.zeros(2, 8, 32), torch.zeros(2, 2, 8, 8)
    values = keys.double()
    handed = beside.handed(0, {}, {"shared_kv_states": {"full_attention": (keys, keys)}}, hidden)
    assert [n for n, _ in handed] == list(beside.names()) and torch.equal(handed[0][1], keys.transpose(1, 2))
    why = re.escape("the shared full_attention values (torch.float64, shape (2, 2, 8, 8)) cannot be carried")
    with pytest.raises(ValueError, match=why):
        beside.handed(0, {}, {"shared_kv_states": {"full_attention": (keys, values)}}, hidden)


class _TakingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(
        self, hidden_states: Tensor, per_layer_input: Any = None, shared_kv_states: Any = None
    ) -> Tensor:
        out: Tensor = self.linear(hidden_states)
        return out


class _TakingLM(nn.Module):
    """A model whose layers take per-layer inputs and shared keys and values (its config switches
    both on), made otherwise than Gemma's: its base has no ``get_per_layer_inputs``, its layers no
    attention keyed by layer type."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            model_type="taking", hidden_size_per_layer_input=4, num_kv_shared_layers=1
        )
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(16, 8)
        self.model.layers = nn.ModuleList([_TakingLayer(), _TakingLayer()])
        self.model.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 16)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def test_what_is_not_made_as_gemmas_is_refused_naming_it() -> None:
    why = (
        "taking cannot be cut into pipeline stages: its layers (_TakingLayer) take per-layer embeddings of "
        "the token ids (per_layer_input) and keys and values of earlier layers (shared_kv_states) beside"
    )
    with pytest.raises(ValueError, match=re.escape(why)):
        decoder_blocks(_TakingLM())


# ---------------------------------------------------------------------------- tier 2
Run = tuple[list[float], dict[str, Tensor]]
SCHEDULES = {
    "1f1b": ParallelConfig(pp=2, microbatches=2, schedule="1f1b"),
    "interleaved": ParallelConfig(pp=2, microbatches=4, schedule="interleaved-1f1b", virtual_stages=2),
}


def _config(schedule: str) -> Config:
    """pp=2 comparable with `serial_run`: fp32, no clipping."""
    parallel = SCHEDULES[schedule]
    c = Config(parallel=parallel, zero=ZeroConfig(stage=1), train=TrainConfig(precision="fp32"))  # type: ignore[arg-type]
    return dataclasses.replace(c, optim=dataclasses.replace(c.optim, clip_grad_norm=0.0))


def _parallel(rank: int, config: Config, case: str) -> tuple[Run, list[int]]:
    model: nn.Module = _hf(case)  # boost() converts its mixtures itself
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config)
    losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
    weights = engine.full_state_dict()
    mine = {id(p) for p in engine.module.parameters()}  # this rank's stages
    layers: Any = model.model.layers  # type: ignore[union-attr]
    held = [i for i, layer in enumerate(layers) if any(id(p) in mine for p in layer.parameters())]
    engine.mesh.close()
    return (losses, weights), held


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", ["gemma4-shared", "deepseek_v4-hash2"])
def test_what_the_first_stage_carries_crosses_the_stages_as_serially(
    worker_pools: PoolFactory, case: str, schedule: str
) -> None:
    config = _config(schedule)
    results = worker_pools(config.world_size).run(_parallel, config, case, timeout=240)
    held = [h for _, h in results]
    assert sorted(i for h in held for i in h) == [0, 1] and held[0] != held[1], (
        held
    )  # layer 1 on another stage
    assert_matches_serial([run for run, _ in results], serial_run(_model(case), TOKENS.first(STEPS), sgd(LR)))
