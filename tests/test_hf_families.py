"""Every decoder-only family of the pinned ``transformers`` through ``boost()`` with no plan
and no blocks written: each equals its serial run in every mode it takes.

Each family is built from its own config class at a tiny size (random weights, nothing
downloaded; dropout off, so serial and parallel runs draw nothing), trains 3 SGD steps
(momentum) on the worker pool, and is compared with the same model trained serially (plain
PyTorch: forward, mean cross-entropy, backward, SGD). Bounds as ``test_user_models``: losses
rel 1e-5 (fp32: a mean over 128 token losses summed in another order by tp, dp and
microbatches) and the consolidated weights atol 1e-6 + rtol 1e-5 (SGD with momentum is linear
in the gradient: round-off). The silent errors this guards against are far larger: Gemma's
embedding without its sqrt(hidden) scale moved the loss by 4.3e-3 relative and the
embedding by 5.1e-3, Mistral's pipeline without its sliding window moved ``v_proj`` by 3.4e-3.

Mistral, Phi3, Gemma2 and Gemma3 have sliding windows shorter than the sequence (8 of 16),
so a pipeline stage that rebuilt a plain causal mask would differ, and so would ring or
Ulysses attention that applied the window to each rank's chunk alone. Modes: tp2, tp2 + SP,
pp2 (1F1B, 2 microbatches), dp2 ZeRO-3 and ring attention (cp2) for every family; dp2 x tp2
for a few, Ulysses (zigzag) for the windows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, boost
from tessera.launcher.families.spec import model_spec, refusals
from tessera.launcher.testing import (
    RandomTokens,
    Run,
    assert_losses_close,
    assert_matches_serial,
    boosted_run,
    oracle_config,
    serial_run,
    sgd,
)

VOCAB, SEQ, BATCH, STEPS, LR = 64, 16, 8, 3, 0.5
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# Llama-shaped sizes: 4 query heads of width 8, 2 KV heads
_COMMON = {
    **_IDS, "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip
_NO_DROPOUT = {"attention_dropout": 0.0, "hidden_dropout": 0.0}


def _family(name: str) -> tuple[str, str, dict[str, Any]]:
    """(config class, model class, config arguments) of one family."""
    return {
        "mistral": ("MistralConfig", "MistralForCausalLM", {**_COMMON, "sliding_window": 8}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _COMMON),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_COMMON, "head_dim": 8}),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_COMMON, "head_dim": 8}),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**_COMMON, "head_dim": 8, "sliding_window": 8}),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**_COMMON, "head_dim": 8, "sliding_window": 8}),
        "phi": ("PhiConfig", "PhiForCausalLM", {**_COMMON, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_COMMON, "sliding_window": 8}),
        "gpt_neox": (
            "GPTNeoXConfig", "GPTNeoXForCausalLM",
            {**_COMMON, "num_key_value_heads": None, "hidden_dropout": 0.0, "attention_dropout": 0.0},
        ),
        "gptj": (
            "GPTJConfig", "GPTJForCausalLM",
            {**_IDS, "vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4,
             "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
        ),
        "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {**_COMMON, "residual_dropout": 0.0}),
        "olmo": ("OlmoConfig", "OlmoForCausalLM", _COMMON),
        "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _COMMON),
        "cohere": ("CohereConfig", "CohereForCausalLM", _COMMON),
        "granite": (
            "GraniteConfig", "GraniteForCausalLM",
            {**_COMMON, "embedding_multiplier": 3.0, "logits_scaling": 2.0, "residual_multiplier": 0.5},
        ),
        "stablelm": ("StableLmConfig", "StableLmForCausalLM", {**_COMMON, "hidden_dropout": 0.0}),
        "falcon": (
            "FalconConfig", "FalconForCausalLM",
            {**_IDS, "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "new_decoder_architecture": True, "num_kv_heads": 2, **_NO_DROPOUT},
        ),
        "bloom": (
            "BloomConfig", "BloomForCausalLM",
            {**_IDS, "vocab_size": VOCAB, "hidden_size": 32, "n_layer": 2, "n_head": 4, **_NO_DROPOUT},
        ),
        "opt": (
            "OPTConfig", "OPTForCausalLM",
            {**_IDS, "vocab_size": VOCAB, "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "max_position_embeddings": 64, "word_embed_proj_dim": 32,
             "dropout": 0.0, "attention_dropout": 0.0},
        ),
    }[name]  # fmt: skip


FAMILIES = [
    "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi", "phi3", "gpt_neox", "gptj",
    "starcoder2", "olmo", "olmo2", "cohere", "granite", "stablelm", "falcon", "bloom", "opt",
]  # fmt: skip


def _build(name: str) -> nn.Module:
    import transformers

    family, _, variant = name.partition("@")
    config_class, model_class, kwargs = _family(family)
    if variant == "nopad":  # the 2D/2.5D/3D embeddings take no padding_idx
        kwargs = {**kwargs, "pad_token_id": None}
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**kwargs)
    return getattr(transformers, model_class)(config)  # type: ignore[no-any-return]


def _serial(name: str) -> Run:
    return serial_run(_build(name), TOKENS.first(STEPS), sgd(LR))


def _parallel(rank: int, name: str, config: Config) -> Run:
    return boosted_run(_build(name), TOKENS.first(STEPS), config, sgd(LR))


MODES: dict[str, tuple[ParallelConfig, int]] = {
    "tp2": (ParallelConfig(tp=2), 0),
    "tp2-sp": (ParallelConfig(tp=2, sequence_parallel=True), 0),
    "pp2": (ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1),
    "dp2-zero3": (ParallelConfig(dp=2), 3),
    "ring": (ParallelConfig(cp=2), 1),
    "ulysses": (ParallelConfig(cp=2, cp_mode="ulysses", cp_layout="zigzag"), 1),
    "dp2-tp2": (ParallelConfig(dp=2, tp=2), 1),
    "2d": (ParallelConfig(tp=4, tp_mode="2d"), 0),
}
DP_TP = ("qwen3", "gemma", "phi3", "gpt_neox")  # dp2 x tp2 for these only (CI time)
ULYSSES = ("mistral", "gemma3", "phi3")  # Ulysses (zigzag) for the sliding windows only
TWO_D = ("qwen2", "gemma", "gpt_neox", "phi")  # 2D (SUMMA, 2 x 2) where the shapes allow it

# (family, mode) -> what the refusal names; boost() refuses these before building anything
REFUSED = {
    ("bloom", "tp2"): "ALiBi",
    ("bloom", "tp2-sp"): "ALiBi",
    ("bloom", "pp2"): "ALiBi",
    ("bloom", "ring"): "ALiBi",
    ("gemma2", "ring"): "soft-capped",
}


def _axes(parallel: ParallelConfig) -> list[str]:
    used = {"tp": parallel.tp > 1, "sequence_parallel": parallel.sequence_parallel, "pp": parallel.pp > 1}
    return [axis for axis, on in {**used, "cp": parallel.cp > 1}.items() if on]


def run_family(pools: PoolFactory, name: str, mode: str) -> None:
    parallel, zero = MODES[mode]
    config = oracle_config(parallel, zero, batch_size=BATCH)
    assert config.validate() == []
    name = f"{name}@nopad" if parallel.tp_mode != "1d" else name
    results = pools(config.world_size).run(_parallel, name, config, timeout=240)
    assert_matches_serial(results, _serial(name))


CASES = [
    (name, mode)
    for name in FAMILIES
    for mode in MODES
    if (name, mode) not in REFUSED
    and (name, mode) != ("olmo2", "tp2-sp")  # its attention kept whole: the derived plan takes no SP
    and (mode != "dp2-tp2" or name in DP_TP)
    and (mode != "ulysses" or name in ULYSSES)
    and (mode != "2d" or name in TWO_D)
]


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_a_family_with_no_plan_equals_its_serial_run(worker_pools: PoolFactory, name: str, mode: str) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed: HF families NOT tested")
    run_family(worker_pools, name, mode)


@pytest.mark.parametrize(("name", "mode"), sorted(REFUSED))
def test_a_mode_a_family_cannot_take_is_refused_in_one_line(name: str, mode: str) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed: HF families NOT tested")
    model = _build(name)
    refused = refusals(model, model_spec(model), _axes(MODES[mode][0]))
    assert len(refused) == 1 and REFUSED[name, mode] in refused[0], refused


def test_boost_refuses_before_building_anything(worker_pools: PoolFactory) -> None:
    """The refusal comes from boost() itself, before any group or conversion (no rank hangs)."""
    pytest.importorskip("transformers", reason="transformers is not installed: HF families NOT tested")
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM \(gemma2\) cannot take cp: .*soft-capped"):
        run_family(worker_pools, "gemma2", "ring")


def _train_and_consolidate(rank: int, name: str, config: Config, folder: str) -> None:
    model = _build(name)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR), config)
    engine.train_step(*TOKENS.at(0))
    if rank == 0:
        model.config.save_pretrained(folder)  # config.json, as transformers writes it
    engine.consolidate(f"{folder}/model.safetensors")
    engine.mesh.close()


@pytest.mark.parametrize("name", ["gemma", "opt"])
def test_a_tied_head_exports_under_both_names(worker_pools: PoolFactory, tmp_path: Any, name: str) -> None:
    """Trained at tp2 and consolidated, a model whose LM head is its token embedding (Gemma, OPT)
    loads strictly into the serial model (both keys present) and through ``from_pretrained``,
    and computes the same logits either way (the same file: exactly)."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed: HF families NOT tested"
    )
    import safetensors.torch

    config = oracle_config(ParallelConfig(tp=2), batch_size=BATCH)
    worker_pools(2).run(_train_and_consolidate, name, config, str(tmp_path), timeout=240)
    weights = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    serial = _build(name)
    head = serial.get_output_embeddings()
    assert head is not None and head.weight is serial.get_input_embeddings().weight
    serial.load_state_dict(weights, strict=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    ids = TOKENS.at(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, serial(ids).logits, rtol=0, atol=0)


def _twin_verified(rank: int, name: str, config: Config, broken: bool) -> list[float]:
    model = _build(name)
    spec = None
    if broken:  # a loss that differs by rank: its parallel step is not the serial one
        base = model_spec(model)

        def loss(logits: Tensor, targets: Tensor) -> Tensor:
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) * (1.0 + rank)

        spec = dataclasses.replace(base, loss=loss)
    engine = boost(
        model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config, spec=spec, verify="twin"
    )
    losses = [engine.train_step(*batch).loss for batch in TOKENS.first(STEPS)]
    engine.mesh.close()
    return losses


@pytest.mark.parametrize(("name", "mode"), [("gemma2", "tp2-sp"), ("qwen3", "pp2"), ("phi3", "dp2-tp2")])
def test_verify_on_a_shrunken_twin_passes_a_correct_layout(
    worker_pools: PoolFactory, name: str, mode: str
) -> None:
    """verify='twin' checks the layout on a 2-layer twin of width 8 per head, then trains the
    model itself (unverified) exactly as without it: the same losses as the serial run."""
    pytest.importorskip("transformers", reason="transformers is not installed: HF families NOT tested")
    parallel, zero = MODES[mode]
    config = oracle_config(parallel, zero, batch_size=BATCH)
    results = worker_pools(config.world_size).run(_twin_verified, name, config, False, timeout=240)
    assert_losses_close(results, _serial(name)[0])


def test_verify_on_a_shrunken_twin_refuses_a_wrong_step(worker_pools: PoolFactory) -> None:
    """A loss that differs between dp ranks makes the parallel step differ from the serial one:
    the twin's verified step refuses it before the model itself is touched."""
    pytest.importorskip("transformers", reason="transformers is not installed: HF families NOT tested")
    config = oracle_config(ParallelConfig(dp=2), 1, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"differ"):
        worker_pools(2).run(_twin_verified, "qwen2", config, True, timeout=240)


# ---------------------------------------------------------------------------- roles derived
def _own(name: str) -> nn.Module:
    from tessera.models.foreign import ForeignConfig, GPT2ish, Llamaish

    config = ForeignConfig(vocab=VOCAB, dim=32, heads=4, kv_heads=2, layers=2, hidden=64, max_len=SEQ)
    torch.manual_seed(0)
    return Llamaish(config) if name == "llamaish" else GPT2ish(config)


def _own_run(rank: int, name: str, config: Config) -> Run:
    # no plan: the roles are derived from its module tree
    return boosted_run(_own(name), TOKENS.first(STEPS), config, sgd(LR))


@pytest.mark.parametrize("mode", ["tp2", "tp2-sp"])
@pytest.mark.parametrize("name", ["llamaish", "gpt2ish"])
def test_roles_derived_for_a_model_with_names_of_its_own(
    worker_pools: PoolFactory, name: str, mode: str
) -> None:
    """``Llamaish`` (attention class ``GQA`` with ``wq``..``wo``, SwiGLU ``w1``/``w3``/``w2`` with the
    output layer registered before the last input) and ``GPT2ish`` (fused ``qkv``, learned
    positions, LayerNorms) get their roles from their module trees alone; bounds as above."""
    parallel, zero = MODES[mode]
    config = oracle_config(parallel, zero, batch_size=BATCH)
    serial = serial_run(_own(name), TOKENS.first(STEPS), sgd(LR))
    assert_matches_serial(worker_pools(2).run(_own_run, name, config, timeout=240), serial)


def test_derived_roles_are_logged_as_a_plan_to_copy() -> None:
    from tessera.launcher.families.derived_roles import derive_roles, describe
    from tessera.tensor_parallel import Plan

    plan = derive_roles(_own("llamaish"))
    roles = dict(plan.entries)
    want = {"layers.*.attn": "attention", "layers.*.ffn.w2": "rowwise", "layers.*.ffn.w3": "colwise"}
    want["output"] = "head"
    assert {k: roles[k].name for k in want} == want
    text = describe(plan)
    assert "'layers.*.attn.wo': 'rowwise'" in text and "'tok_embeddings': 'vocab_whole'" in text
    assert dict(Plan.of(eval(text)).entries).keys() == roles.keys()  # what a user pastes back


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_has_its_attention_and_mlp_split(name: str) -> None:
    """The derived plan splits both halves of every layer (OPT's ``fc1`` and ``fc2`` sit on the
    layer itself, with no module of their own to be a region), but OLMo2's attention, whose
    ``q_norm`` and ``k_norm`` span all heads: kept whole, so no sequence parallelism."""
    pytest.importorskip("transformers", reason="transformers is not installed: HF families NOT tested")
    from tessera.launcher.families.derived_roles import derive_roles

    plan = derive_roles(_build(name))
    styles = [style.name for pattern, style in plan.entries if ".*." in pattern]
    whole = name == "olmo2"
    assert styles.count("attention") == (not whole) and styles.count("region") == (name != "opt"), styles
    assert styles.count("rowwise") == 2 - whole, styles  # the attention's output and the MLP's
    assert styles.count("replicate") == whole and plan.supports_sequence_parallel == (not whole), styles
