"""What HF decoder layers carry between them beside one hidden state, through pipeline stages
(``tessera.launcher.families.hf_streams``, used by ``hf.decoder_blocks``).

HunYuan-V4 (``hy_v4``) keeps 4 residual streams stacked (``[batch, seq, hc_mult, hidden]``), mixed
back into one by ``hc_head`` before its norm (which its ``base_model_pp_plan`` leaves out), and its
layers hand their DSA top-k indices (int32) to the next layer, which reuses them where
``config.indexer_types`` says ``"shared"``. The tiny model of ``tiny_moe_model`` (2 layers,
hidden 32, 8 experts, top-2, its clamp lowered to 0.5 as ``test_hf_moe_expert_kinds.py`` builds
it) indexes in both layers; the variant ``hy_v4-shared`` has layer 1 reuse layer 0's top-3 of
the 8 tokens (so a layer 1 given other indices, or none, computes something else or fails).

Inkling 2 (``inkling2_text``) keeps block states beside the hidden states (its attention
residuals: the inputs of the layers that start a block, ``is_block_boundary``, stacked), which
each layer attends over and its ``final_input`` mixes with the last hidden states before its norm;
its embedding is normed, its head softcapped. The tiny model starts a block every 6 layers (so
layer 0 alone: one block state after it); the variant ``inkling2-blocks`` every layer (two), with
a window of 3 of the 8 tokens in its sliding layer 0.

Tier 0: the blocks chained in one process give the model's logits (``check_blocks``: in eval
mode, to 1e-5 of their largest magnitude, as ``boost()`` checks them); `pack` / `unpack` give
back the hidden states and the carried values bitwise in fp32, bf16 and fp64 (values of the
hidden states' dtype copied, with their gradient; others as bytes, no arithmetic); the readings
of HunYuan-V4's and Inkling 2's forwards (what they hand on or keep, the order of their modules after the
layers); a carried value that is not a tensor, and a kept one whose update is not read, are
refused naming them, before anything is partitioned.

Tier 2 (the worker pool): ``hy_v4-shared`` and ``inkling2-blocks`` trained through ``boost()`` at
pp=2 (1F1B, 2 microbatches), 3 SGD steps (momentum 0.9), fp32, no clipping, with layer 1 on the
second stage (so the indices, and the block states with their gradients, cross the stages),
equal their serial runs by ``assert_matches_serial``'s
bounds: losses rel 1e-5 (microbatches sum the mean's terms in another order: a few ulps),
weights rtol 1e-5, atol 1e-6 (SGD is linear in the gradient, so they stay at round-off).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.families.hf import decoder_blocks
from tessera.launcher.families.hf_moe import convert_hf_moe
from tessera.launcher.families.hf_streams import (
    applied_order,
    carried_between_layers,
    kept_between_layers,
    pack,
    unpack,
)
from tessera.launcher.families.spec import check_blocks, logits_of
from tessera.launcher.testing import RandomTokens, assert_matches_serial, serial_run, sgd
from tessera.launcher.testing_hf_moe import tiny_moe_model, token_ids

pytest.importorskip("transformers", reason="transformers is not installed: HF pipeline blocks NOT tested")

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 4, 3, 0.2
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "hy_v4": ("hy_v4", {"swiglu_limit": 0.5}),
    "hy_v4-shared": ("hy_v4", {"swiglu_limit": 0.5, "indexer_types": ["full", "shared"], "index_topk": 3}),
    "inkling2_text": ("inkling2_text", {"mlp_gate_softcap": 0.5, "mlp_up_softcap": 0.3}),
    "inkling2-blocks": (
        "inkling2_text",
        {
            "mlp_gate_softcap": 0.5,
            "mlp_up_softcap": 0.3,
            "n_layers_per_attn_res_block": 1,
            "sliding_window": 3,
            "unpadded_vocab_size": VOCAB,  # its head as wide as the vocabulary: the stages split its layers
        },
    ),
}


def _model(case: str) -> Any:
    """The case's tiny model, its MoE blocks converted as ``boost()`` converts them, no cache."""
    family, changes = CASES[case]
    model = tiny_moe_model(family, changes)
    model.config.use_cache = False
    convert_hf_moe(model)
    return model


# ---------------------------------------------------------------------------- tier 0
@pytest.mark.parametrize("case", CASES)
def test_the_blocks_chained_give_the_models_logits(case: str) -> None:
    model = _model(case)
    blocks = decoder_blocks(model)
    assert len(blocks) == 4, [type(b).__name__ for b in blocks]
    check_blocks(model, blocks, token_ids(1), logits_of)


def test_the_variants_have_what_they_are_for() -> None:
    """``hy_v4-shared``'s layer 1 has no indexer of its own, and 3 of 8 keys are kept: indices
    that would be lost or replaced change what it computes; every layer of ``inkling2-blocks``
    starts a block, its layer 0 a window narrower than the sequence."""
    model = _model("hy_v4-shared")
    attention = [layer.self_attn for layer in model.model.layers]
    assert attention[0].indexer is not None and attention[1].indexer is None
    assert model.config.index_topk < SEQ
    inkling = _model("inkling2-blocks")
    assert [layer.is_block_boundary for layer in inkling.model.layers] == [True, True]
    assert inkling.config.layer_types[0] == "hybrid_sliding" and inkling.config.sliding_window < SEQ


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pack_gives_back_what_it_holds_bitwise(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 4, 5, generator=gen).to(dtype).requires_grad_()
    indices = torch.randint(0, 8, (2, 3, 3), generator=gen, dtype=torch.int32)
    flags = torch.rand(2, 3, generator=gen) > 0.5
    states = torch.randn(2, 3, 2, 5, generator=gen).to(dtype).requires_grad_()  # as values
    carried = [("indices", indices), ("none", None), ("states", states), ("flags", flags)]
    packed = pack(hidden, carried)
    assert packed.dtype == dtype and packed.shape[:2] == (2, 3)
    got, (got_indices, nothing, got_states, got_flags) = unpack(packed)
    assert torch.equal(got, hidden) and nothing is None
    assert got_indices is not None and got_indices.dtype == torch.int32 and torch.equal(got_indices, indices)
    assert got_flags is not None and torch.equal(got_flags, flags)
    assert got_states is not None and torch.equal(got_states, states)
    weights = torch.randn(hidden.shape, generator=gen).to(dtype)
    (got * weights).sum().add(got_states.sum() * 2).backward()  # the gradient reaches the values
    assert hidden.grad is not None and torch.equal(hidden.grad, weights)
    assert states.grad is not None and torch.equal(states.grad, torch.full_like(states, 2))
    empty = unpack(pack(hidden.detach(), [("states", states.detach()[..., :0, :])]))[1][0]
    assert empty is not None and empty.shape == (2, 3, 0, 5)  # Inkling 2's first block states
    plain, none = unpack(pack(hidden.detach()[..., 0, 0], []))  # nothing carried, 2-D hidden states
    assert torch.equal(plain, hidden.detach()[..., 0, 0]) and none == []


def test_hunyuan_v4s_forward_is_read() -> None:
    base = type(_model("hy_v4").model)
    assert carried_between_layers(base.forward, "layers") == {"prev_topk_indices": 1}
    applied = applied_order(base.forward)
    after = applied[len(applied) - applied[::-1].index("layers") :]
    assert after.index("hc_head") < after.index("norm"), after  # self.norm(self.hc_head(h))
    llama = type(tiny_moe_model("qwen3_moe").model)
    assert carried_between_layers(llama.forward, "layers") == {}
    assert kept_between_layers(llama.forward, "layers") == {}


def test_inkling_2s_forward_is_read() -> None:
    base = type(_model("inkling2_text").model)
    assert kept_between_layers(base.forward, "layers") == {"block_states": "is_block_boundary"}
    assert carried_between_layers(base.forward, "layers") == {}
    applied = applied_order(base.forward)
    after = applied[len(applied) - applied[::-1].index("layers") :]
    assert after.index("final_input") < after.index("norm"), after


class _NotedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, hidden_states: Tensor, note: Any = None) -> tuple[Tensor, str]:
        return self.linear(hidden_states), "a note"


class _NotedBase(nn.Module):
    """A model whose forward hands each layer a string its layer before returned."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_NotedLayer(), _NotedLayer()])
        self.norm = nn.LayerNorm(8)

    def forward(self, input_ids: Tensor) -> Tensor:
        hidden_states, note = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, note = layer(hidden_states, note=note)
        out: Tensor = self.norm(hidden_states)
        return out


class _NotedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model, self.lm_head = _NotedBase(), nn.Linear(8, 16)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: Tensor) -> Tensor:
        out: Tensor = self.lm_head(self.model(input_ids))
        return out


def test_a_carried_value_that_is_not_a_tensor_is_refused_naming_it() -> None:
    model = _NotedLM()
    blocks = decoder_blocks(model)
    why = re.escape("_NotedLayer's output 1 (note) (str) cannot be carried to the next pipeline stage")
    with pytest.raises(ValueError, match=why):
        check_blocks(model, blocks, torch.zeros(2, 4, dtype=torch.long), lambda out: out)


class _KeptBase(nn.Module):
    """A model whose forward hands each layer a running sum beside the hidden states, updated by
    a rule the blocks do not read (every layer, not on a layer's attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_NotedLayer(), _NotedLayer()])
        self.norm = nn.LayerNorm(8)

    def forward(self, input_ids: Tensor) -> Tensor:
        hidden_states = self.embed_tokens(input_ids)
        total = torch.zeros_like(hidden_states)
        for layer in self.layers:
            total = total + hidden_states
            hidden_states, _ = layer(hidden_states, total)
        out: Tensor = self.norm(hidden_states)
        return out


def test_what_a_model_keeps_by_a_rule_not_read_is_refused_naming_it() -> None:
    model = _NotedLM()
    model.model = _KeptBase()
    why = re.escape("_KeptBase cannot be cut into pipeline stages: its forward hands its layers ['total']")
    with pytest.raises(ValueError, match=why):
        decoder_blocks(model)


# ---------------------------------------------------------------------------- tier 2
Run = tuple[list[float], dict[str, Tensor]]


def _config() -> Config:
    """pp=2 (1F1B, 2 microbatches) comparable with `serial_run`: fp32, no clipping."""
    parallel = ParallelConfig(pp=2, microbatches=2, schedule="1f1b")
    c = Config(parallel=parallel, zero=ZeroConfig(stage=1), train=TrainConfig(precision="fp32"))  # type: ignore[arg-type]
    return dataclasses.replace(c, optim=dataclasses.replace(c.optim, clip_grad_norm=0.0))


def _parallel(rank: int, config: Config, case: str) -> tuple[Run, list[int]]:
    family, changes = CASES[case]
    model = tiny_moe_model(family, changes)  # boost() converts its blocks itself
    model.config.use_cache = False
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config)
    losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
    weights = engine.full_state_dict()
    mine = {id(p) for p in engine.module.parameters()}  # this rank's stage
    layers = model.model.layers  # type: ignore[union-attr]
    held = [i for i, layer in enumerate(layers) if any(id(p) in mine for p in layer.parameters())]
    engine.mesh.close()
    return (losses, weights), held


@pytest.mark.parametrize("case", ["hy_v4-shared", "inkling2-blocks"])
def test_what_layers_carry_crosses_the_stages_as_serially(worker_pools: PoolFactory, case: str) -> None:
    config = _config()
    results = worker_pools(config.world_size).run(_parallel, config, case, timeout=180)
    assert [held for _, held in results] == [[0], [1]]  # layer 1 reads what crossed from the other stage
    model = _model(case)
    assert_matches_serial([run for run, _ in results], serial_run(model, TOKENS.first(STEPS), sgd(LR)))
