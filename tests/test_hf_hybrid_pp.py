"""Pipeline parallelism for the Hugging Face families whose layers are not all attention layers
or need more than a causal mask: hybrids of Mamba or linear-attention layers with attention
layers (Jamba, GraniteMoeHybrid, Lara-mini, Qwen3.5-MoE, Qwen3-Next; dense: Bamba, Qwen3.5),
GraniteMoE-SWA (a rotary module per base frequency in a second ``ModuleList``, chosen per layer
by ``layer_rope_theta``, 0 for none; sliding and full attention layers) and the DSA models
(DeepSeek-V3.2, GLM-MoE-DSA), whose indexer reads the causal mask that SDPA's ``is_causal``
would otherwise leave unbuilt. ``hf.decoder_blocks`` gives each layer what the model's forward
gives it (the mask of its layer kind, positions, rotary embeddings).

Built by ``tests/survey_hf_moe.py``'s ``build`` (2 layers, hidden 32, 8 experts, top-2;
loaded by its path), as ``test_hf_moe_families.py`` trains them, and as variants whose
features act at these sizes: the survey's Jamba and GraniteMoeHybrid have two Mamba layers
(so a variant with layer 1 attention; GraniteMoeHybrid's with rotary embeddings), its
GraniteMoE-SWA one base frequency and a window wider than the sequence (so a variant with
frequency 500 in layer 0, none in layer 1, and a window of 4 of the 8 tokens); Bamba's
likewise two Mamba layers (variant: layer 1 attention).

Tier 0: the blocks chained in one process give the model's logits (``check_blocks``: in eval
mode, to 1e-5 of their largest magnitude, as ``boost()`` checks them); the blocks' hooks leave
the model's own forward as it was (bitwise, with a padding mask the hooks would replace), so
that check compares against ``transformers``' logits; Zamba, whose layers take the embeddings'
output beside the hidden states, is refused with a ValueError naming it. Tier 2 (the worker
pool): each trained at pp=2 (1F1B, 2 microbatches; one at zbv with 2 stages a rank), 3 SGD
steps (momentum 0.9), fp32, no clipping, equals its serial run by ``assert_matches_serial``'s
bounds: losses rel 1e-5 (microbatches sum the mean's terms in another order: a few ulps),
each rank's stage weights rtol 1e-5, atol 1e-6 (SGD is linear in the gradient, so they stay at
round-off). A layer given another mask, rotary or none is off at order 1e-2 or more.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.families.hf import decoder_blocks
from tessera.launcher.families.hf_moe import convert_hf_moe
from tessera.launcher.families.spec import check_blocks, logits_of, model_spec, refusals
from tessera.launcher.testing import RandomTokens, assert_matches_serial, serial_run, sgd
from tessera.launcher.testing_hf_moe import tiny_moe_model, token_ids
from tessera.zero import Precision

pytest.importorskip("transformers", reason="transformers is not installed: HF hybrids NOT tested")

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 4, 3, 0.2
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)


# case -> (model_type, config changes); the families test_hf_moe_families.py lists in NO_PP first
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    **{
        family: (family, {})
        for family in (
            "granitemoehybrid", "granitemoe_swa", "jamba", "lara_mini", "qwen3_5_moe_text", "qwen3_next",
            "deepseek_v32", "glm_moe_dsa",
        )
    },
    "jamba-attention": ("jamba", {"attn_layer_period": 2, "attn_layer_offset": 1}),
    "granitemoehybrid-attention": (
        "granitemoehybrid", {"layer_types": ["mamba", "attention"], "position_embedding_type": "rope"}
    ),
    "granitemoe_swa-thetas": ("granitemoe_swa", {"layer_rope_theta": [500.0, 0.0], "sliding_window": 4}),
    "bamba-attention": ("bamba", {"attn_layer_indices": [1]}),
    "qwen3_5_text": ("qwen3_5_text", {}),
}  # fmt: skip


def _built(family: str, changes: dict[str, Any]) -> Any:
    """The tiny model of ``family`` (every parameter drawn from seed 0), its config with
    ``changes`` (passed where its config class has them)."""
    return tiny_moe_model(family, settings=changes)


def _model(case: str) -> Any:
    """The case's tiny model, its MoE blocks converted as ``boost()`` converts them, no cache."""
    model = _built(*CASES[case])
    model.config.use_cache = False
    convert_hf_moe(model)
    return model


# ---------------------------------------------------------------------------- tier 0
@pytest.mark.parametrize("case", CASES)
def test_the_blocks_chained_give_the_models_logits(case: str) -> None:
    model = _model(case)
    check_blocks(model, decoder_blocks(model), token_ids(1), logits_of)


def test_the_models_own_forward_keeps_its_arguments() -> None:
    """The blocks hook the attention modules, and those hooks stand aside in the model's own
    forward: its padding mask stays its own (so ``boost()`` checks the blocks against the logits
    ``transformers`` computes, not against the blocks' own arguments). Bitwise: the same calls."""
    model = _model("granitemoe_swa-thetas").eval()
    ids, padding = token_ids(1), torch.ones(2, SEQ, dtype=torch.long)
    padding[:, -3:] = 0  # right padding: every query still sees the first key
    want = model(ids, attention_mask=padding).logits
    decoder_blocks(model)
    torch.testing.assert_close(model(ids, attention_mask=padding).logits, want, rtol=0, atol=0)


def test_the_variants_have_what_they_are_for() -> None:
    """Each variant holds the feature the survey's build lacks at these sizes."""
    jamba: Any = _model("jamba-attention").model
    assert [type(m).__name__ for m in jamba.layers] == [
        "JambaMambaDecoderLayer",
        "JambaAttentionDecoderLayer",
    ]
    hybrid: Any = _model("granitemoehybrid-attention").model
    assert hybrid.layers[0].mamba is not None and hybrid.layers[1].self_attn is not None
    assert hybrid.rotary_emb is not None
    swa: Any = _model("granitemoe_swa-thetas")
    assert swa.config.sliding_window < SEQ
    assert [r.config.rope_parameters["rope_theta"] for r in swa.model.rotary_embs] == [500.0]
    bamba: Any = _model("bamba-attention").model
    assert hasattr(bamba.layers[0], "mamba") and hasattr(bamba.layers[1], "self_attn")


def test_zamba_is_refused_naming_why() -> None:
    """Zamba's hybrid layers read the embeddings' output beside the hidden states: no chain of
    stages passes it, so the blocks are refused (a ValueError, before any layer runs)."""
    model = _built("zamba", {"layer_types": ["mamba", "hybrid"]})  # the survey's: 3 kinds for 2 layers
    why = r"zamba cannot be cut into pipeline stages: its layers \(ZambaMambaDecoderLayer\) take the emb"
    with pytest.raises(ValueError, match=why):
        decoder_blocks(model)
    # boost() refuses it before making any process group (the family's spec)
    refused = refusals(model, model_spec(model), ["pp"])
    assert len(refused) == 1 and "original_hidden_states" in refused[0], refused


# ---------------------------------------------------------------------------- tier 2
MODES = {
    "1f1b": ParallelConfig(pp=2, microbatches=2, schedule="1f1b"),
    "zbv": ParallelConfig(pp=2, microbatches=2, schedule="zbv", virtual_stages=2),
}
Run = tuple[list[float], dict[str, Tensor]]


def _config(mode: str) -> Config:
    """The run comparable with `serial_run`: fp32, ZeRO 1, no clipping."""
    c = Config(parallel=MODES[mode], zero=ZeroConfig(stage=1), train=TrainConfig(precision=Precision.FP32))
    return dataclasses.replace(c, optim=dataclasses.replace(c.optim, clip_grad_norm=0.0))


def _parallel(rank: int, config: Config, case: str) -> Run:
    model = _model(case)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config)
    losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
    weights = engine.full_state_dict()  # this rank's pipeline stages' weights
    engine.mesh.close()
    return losses, weights


PP_CASES = [(case, "1f1b") for case in CASES] + [("qwen3_next", "zbv")]


@pytest.mark.parametrize(("case", "mode"), PP_CASES)
def test_a_hybrid_trains_at_pp2_as_serially(worker_pools: PoolFactory, case: str, mode: str) -> None:
    config = _config(mode)
    results = worker_pools(config.world_size).run(_parallel, config, case, timeout=180)
    assert_matches_serial(results, serial_run(_model(case), TOKENS.first(STEPS), sgd(LR)))
