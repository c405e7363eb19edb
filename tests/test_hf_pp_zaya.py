"""ZAYA cut into pipeline stages (``hf.decoder_blocks``), its mixtures converted (their routers kept:
``families/hf_moe_kept.py``), with no plan.

``ZayaModel.forward`` does three things around its layers that a chain of blocks must reproduce:

- it applies parameters of its own (not a module's) to the embeddings' output,
  ``((h + self.input_hidden_states_bias) * self.input_hidden_states_scale).to(torch.float32)``: the
  first block holds them (``hf_base_parameters.BaseParameters``), so the first stage trains them;
- it hands each layer ``attention_mask={"causal": <the mask of the layer's kind>, "conv": <the
  padding mask>}`` (``hf_layout.masks_by_key``), whose CCA attention reads the dict;
- it hands each layer the router state the layer before returned, by position, inside
  ``for idx, decoder_layer in enumerate(self.layers)`` (``hf_streams.carried_between_layers`` with
  the layer's parameters): layer 1's router adds it (``use_eda``), so it crosses the stages.

The tiny model of ``tiny_moe_model`` (2 layers of kind ``hybrid``, hidden 32, 8 experts, top-1, a
router state of width 256) with its own scale and bias drawn far from 1 and 0 (|scale| in [1.5,
2.5], |bias| in [0.5, 1.5], random signs): blocks that forgot them would compute other logits.
The variant ``zaya-sliding`` has a sliding layer 0 (window 3 of the 8 tokens), whose attention reads
a mask tensor from the dict (a mask not in a dict fails there).

Tier 0: the blocks chained give the model's logits (``check_blocks``: eval mode, to 1e-5 of their
largest magnitude, as ``boost()`` checks them); what the blocks read of ZAYA's forward; a statement
applying a model's own parameters, a dict of masks, or a carried value the blocks cannot read are
refused naming them, before anything is partitioned; in a bf16 model the router state (bf16 beside
the fp32 residual stream) would cross the stages as bytes, without its gradient: refused naming it
when it has one (a training step), carried bitwise when not.

Tier 2 (the worker pool): trained through ``boost()`` with no plan (3 SGD steps, momentum 0.9,
fp32, no clipping) at pp=2 with 1F1B (2 microbatches) and interleaved 1F1B (2 stages a rank, 4
microbatches), and at dp=2 x pp=2 (1F1B, the first stage's gradients reduced over dp, its own
parameters among them), layer 1 on a later stage than layer 0, equal their serial runs by
``assert_matches_serial``'s bounds: losses rel 1e-5 (microbatches sum the mean's terms in another
order: a few ulps), weights rtol 1e-5, atol 1e-6 (SGD is linear in the gradient, so they stay at
round-off; the serial run moves the scale and bias by far more).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, boost
from tessera.launcher.families.hf import decoder_blocks
from tessera.launcher.families.hf_base_parameters import BaseParameters, base_parameters
from tessera.launcher.families.hf_layout import masks_by_key
from tessera.launcher.families.hf_moe import convert_hf_moe
from tessera.launcher.families.hf_streams import carried_between_layers, kept_between_layers, unpack
from tessera.launcher.families.spec import check_blocks, logits_of
from tessera.launcher.testing import RandomTokens, assert_matches_serial, oracle_config, serial_run, sgd
from tessera.launcher.testing_hf_moe import tiny_moe_model, token_ids

pytest.importorskip("transformers", reason="transformers is not installed: ZAYA's pipeline blocks NOT tested")

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 4, 3, 0.2
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)
CASES: dict[str, dict[str, Any]] = {
    "zaya": {},
    "zaya-sliding": {"layer_types": ["hybrid_sliding", "hybrid"], "sliding_window": 3},
}
OWN = ("input_hidden_states_scale", "input_hidden_states_bias")


def _hf(case: str) -> Any:
    """The case's tiny HF model, no cache, its own scale and bias drawn far from 1 and 0."""
    model: Any = tiny_moe_model("zaya", CASES[case] or None)
    model.config.use_cache = False
    gen = torch.Generator().manual_seed(3)
    base = model.model
    with torch.no_grad():
        for param, low in ((base.input_hidden_states_scale, 1.5), (base.input_hidden_states_bias, 0.5)):
            sign = torch.randint(0, 2, param.shape, generator=gen) * 2 - 1
            param.copy_(sign * torch.empty(param.shape).uniform_(low, low + 1, generator=gen))
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
    assert len(blocks) == 4, [type(b).__name__ for b in blocks]
    check_blocks(model, blocks, token_ids(1), logits_of)


def test_the_variants_have_what_they_are_for() -> None:
    """Layer 1's router adds the state layer 0 hands on; the scale and bias are far from 1 and 0;
    ``zaya-sliding``'s layer 0 attends over a window narrower than the sequence."""
    model = _hf("zaya")
    gates = [layer.mlp.gate for layer in model.model.layers]
    assert not gates[0].use_eda and gates[1].use_eda
    scale, bias = (model.model.get_parameter(n).detach() for n in OWN)
    assert bool((scale.abs() >= 1.5).all()) and bool((bias.abs() >= 0.5).all())
    sliding = _hf("zaya-sliding")
    assert sliding.model.layers[0].self_attn.sliding_window == 3 < SEQ
    assert sliding.model.layers[1].self_attn.sliding_window is None


def test_what_the_blocks_read_of_zayas_forward() -> None:
    """The router state by position (named by the layer's parameter), the dict of masks by kind
    (None: the layer's own), and the model's own parameters: held by the first block as the very
    tensors of the model (so the first stage trains them), applied as the forward applies them."""
    model = _model("zaya")
    base, forward = model.model, type(model.model).forward
    params = list(inspect.signature(base.layers[0].forward).parameters)
    assert params[:2] == ["hidden_states", "prev_router_hidden_states"]
    assert carried_between_layers(forward, "layers", params) == {"prev_router_hidden_states": 1}
    assert kept_between_layers(forward, "layers") == {}  # what a layer hands on is not kept
    assert masks_by_key(forward, "layers") == {"causal": None, "conv": "conv"}
    own = base_parameters(base, "layers")
    assert isinstance(own, BaseParameters)
    assert {n: id(p) for n, p in own.named_parameters()} == {n: id(base.get_parameter(n)) for n in OWN}
    first = decoder_blocks(model)[0]
    assert {id(base.get_parameter(n)) for n in OWN} <= {id(p) for p in first.parameters()}
    h = torch.randn(2, 3, 32)
    want = ((h + base.input_hidden_states_bias) * base.input_hidden_states_scale).float()
    torch.testing.assert_close(own(h), want, rtol=0, atol=0)  # the same operations: bitwise


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(
        self, hidden_states: Tensor, state: Any = None, attention_mask: Any = None
    ) -> tuple[Tensor, Tensor]:
        return self.linear(hidden_states), hidden_states


class _Base(nn.Module):
    """A model with a parameter of its own, applied before its layers through a local name (which
    the blocks do not read), handing its layers a dict of masks and a state by position."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 8)
        self.gain = nn.Parameter(torch.ones(8))
        self.layers = nn.ModuleList([_Layer(), _Layer()])
        self.norm = nn.LayerNorm(8)

    def forward(self, input_ids: Tensor, masks: Any = None, extra: Any = None) -> Tensor:
        hidden_states, state = self.embed_tokens(input_ids), None
        gain = self.gain * 2
        hidden_states = hidden_states * gain
        for i, layer in enumerate(self.layers):
            hidden_states, state = layer(hidden_states, state, attention_mask={"causal": masks[i]})
        out: Tensor = self.norm(hidden_states)
        return out


class _OtherMasks(_Base):
    """A model handing its layers a dict of masks with an entry that looks up no mask by kind."""

    def forward(self, input_ids: Tensor, masks: Any = None, extra: Any = None) -> Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states, _ = layer(hidden_states, attention_mask={"causal": masks["full"], "x": extra})
        out: Tensor = self.norm(hidden_states)
        return out


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model, self.lm_head = _Base(), nn.Linear(8, 16)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def test_what_the_blocks_cannot_read_is_refused_naming_it() -> None:
    forward = _Base.forward
    why = "the forward hands its layers 'state' (their output 1) as argument 1, beyond their parameters ['h']"
    with pytest.raises(ValueError, match=re.escape(why)):
        carried_between_layers(forward, "layers", ["h"])
    assert carried_between_layers(forward, "layers", ["hidden_states", "state"]) == {"state": 1}
    assert masks_by_key(forward, "layers") == {"causal": None}
    with pytest.raises(ValueError, match=re.escape("a dict of masks whose entry {'x': extra} the pipeline")):
        masks_by_key(_OtherMasks.forward, "layers")
    assert masks_by_key(type(_model("zaya").model).forward, "layers") == {"causal": None, "conv": "conv"}
    why = (
        "_Base cannot be cut into pipeline stages: its forward applies its own parameters ['gain'] before "
        "its layers by `gain = self.gain * 2`, which the blocks do not read (its target)"
    )
    with pytest.raises(ValueError, match=re.escape(why)):
        decoder_blocks(_LM())


def test_a_bf16_zayas_router_state_is_refused_not_dropped() -> None:
    """In bf16 ZAYA's residual stream stays fp32 (its forward's ``.to(torch.float32)``) and its router
    state is bf16: as bytes beside the fp32 hidden states it would cross the stages without its
    gradient, so carrying it with a gradient is refused naming it; without one (eval, no_grad, as
    ``check_blocks`` runs them) it travels bitwise."""
    model = _model("zaya").to(torch.bfloat16)
    blocks = decoder_blocks(model)
    why = "ZayaDecoderLayer's output 1 (prev_router_hidden_states) (torch.bfloat16) cannot be carried to the "
    why += (
        "next pipeline stage with its gradient: only a value in the hidden states' dtype (torch.float32) can"
    )
    with pytest.raises(ValueError, match=re.escape(why)):
        blocks[1](blocks[0](token_ids(1)))
    returned: list[Tensor] = []
    hook = model.model.layers[0].register_forward_hook(lambda m, i, out: returned.append(out[1]))
    with torch.no_grad():
        hidden, (state,) = unpack(blocks[1](blocks[0](token_ids(1))))
    hook.remove()
    assert hidden.dtype == torch.float32 and state is not None and state.dtype == torch.bfloat16
    assert torch.equal(state, returned[-1])


# ---------------------------------------------------------------------------- tier 2
Run = tuple[list[float], dict[str, Tensor]]
SCHEDULES = {
    "1f1b": ParallelConfig(pp=2, microbatches=2, schedule="1f1b"),
    "interleaved": ParallelConfig(pp=2, microbatches=4, schedule="interleaved-1f1b", virtual_stages=2),
    "dp2-1f1b": ParallelConfig(dp=2, pp=2, microbatches=2, schedule="1f1b"),
}


def _parallel(rank: int, config: Config, case: str) -> tuple[Run, list[int], tuple[bool, bool]]:
    """One rank's run, the layers its stages hold, and whether it holds the embedding and the
    model's own parameters."""
    model: Any = _hf(case)  # boost() converts its mixtures itself
    embedding, own = model.model.embed_tokens.weight, [model.model.get_parameter(n) for n in OWN]
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config)
    try:
        losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
        weights = engine.full_state_dict()
        mine = {id(p) for p in engine.module.parameters()}  # this rank's stages
    finally:
        engine.mesh.close()
    held = [i for i, layer in enumerate(model.model.layers) if any(id(p) in mine for p in layer.parameters())]
    return (losses, weights), held, (id(embedding) in mine, all(id(p) in mine for p in own))


@pytest.mark.parametrize(
    ("case", "schedule"), [("zaya", "1f1b"), ("zaya", "interleaved"), ("zaya-sliding", "dp2-1f1b")]
)
def test_zaya_trains_at_pp2_as_serially(worker_pools: PoolFactory, case: str, schedule: str) -> None:
    config = oracle_config(SCHEDULES[schedule], 1, batch_size=BATCH)
    results = worker_pools(config.world_size).run(_parallel, config, case, timeout=300)
    held = [h for _, h, _ in results]
    assert sorted({i for h in held for i in h}) == [0, 1] and all(h != [0, 1] for h in held), held
    holds = [owns for _, _, owns in results]  # (the embedding, the own parameters): the first stage's
    assert all(embedding == own for embedding, own in holds) and any(own for _, own in holds), holds
    serial = serial_run(_model(case), TOKENS.first(STEPS), sgd(LR))
    start = _hf(case).model
    for name in OWN:  # the serial run trains them: a stage that did not would be off by an update
        assert float((serial[1][f"model.{name}"] - start.get_parameter(name).detach()).abs().max()) > 1e-3
    assert_matches_serial([run for run, _, _ in results], serial)
