"""LoRA adapters (PEFT) through ``boost()``: a ``peft.get_peft_model`` model trains in every
mode equal to the same PEFT model trained serially, its adapters saved load into ``peft``, and
its merged export loads into ``transformers``.

Each model is a tiny Hugging Face family built from its config (random weights, nothing
downloaded, dropout off) wrapped by PEFT (rank 4, alpha 8); every ``lora_B`` is drawn at random
instead of PEFT's zeros, so the first step already trains both adapter halves. Bounds as
``tests/test_hf_families.py``: losses rel 1e-5, weights atol 1e-6 + rtol 1e-5 after 3 SGD steps
(momentum: linear in the gradient, so round-off stays round-off); the frozen base must come back
unchanged, the adapters moved. A wrong split of an adapter is off by the size of an update:
an ``AfterExit`` ``lora_B`` summed over tp without SP doubles its gradient; a K/V ``lora_B`` split
plainly where its base is split by KV heads moves the keys.

Saved adapters and merged exports are compared as logits on a fresh batch against the serial
model trained the same 2 steps: rtol 1e-4, atol 1e-5 (fp32 round-off through a forward; the
adapters are written in fp32, the merge ``W + s * B @ A`` sums in another order than
``W x + s * B (A x)``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, boost
from tessera.launcher.families.adapters import PEFT_PREFIX, unwrap_peft
from tessera.launcher.testing import (
    RandomTokens,
    Run,
    assert_matches_serial,
    boosted_run,
    oracle_config,
    serial_run,
    sgd,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOKENS = RandomTokens(vocab=64, batch=8, seq=16)
_SIZES = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES: dict[str, tuple[str, str, dict[str, Any], list[str]]] = {
    # name: (config class, model class, config arguments, LoRA targets)
    "llama": ("LlamaConfig", "LlamaForCausalLM", _SIZES, _PROJECTIONS),
    "llama_nopad": ("LlamaConfig", "LlamaForCausalLM", {**_SIZES, "pad_token_id": None}, _PROJECTIONS),
    "llama_head": ("LlamaConfig", "LlamaForCausalLM", _SIZES, _PROJECTIONS),  # + lm_head trained whole
    "llama_mqa": ("LlamaConfig", "LlamaForCausalLM", {**_SIZES, "num_key_value_heads": 1}, _PROJECTIONS[:4]),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _SIZES, ["q_proj", "v_proj", "down_proj"]),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _SIZES, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "gpt2": (
        "GPT2Config", "GPT2LMHeadModel",
        {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
         "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
        ["c_attn", "c_proj", "c_fc"],
    ),
}  # fmt: skip


def build(family: str, **lora: Any) -> nn.Module:
    """The family's tiny model (seeded) wrapped by PEFT, every ``lora_B`` drawn at random."""
    config_cls, model_cls, sizes, targets = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**sizes))
    saved = {"modules_to_save": ["lm_head"]} if family == "llama_head" else {}  # PEFT copies it
    settings = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": targets, **saved, **lora}
    wrapped = peft.get_peft_model(model, peft.LoraConfig(fan_in_fan_out=family == "gpt2", **settings))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return wrapped


def unprefixed(run: Run) -> Run:
    """A serial PEFT run's weights under the base model's names (boost() trains those)."""
    return run[0], {k.removeprefix(PEFT_PREFIX): v for k, v in run[1].items()}


MODES: dict[str, tuple[ParallelConfig, int]] = {
    "dp2-zero3": (ParallelConfig(dp=2), 3),
    "pp2": (ParallelConfig(pp=2, microbatches=2), 0),
    "tp2": (ParallelConfig(tp=2), 0),
    "tp2-sp": (ParallelConfig(tp=2, sequence_parallel=True), 0),
    "dp2-tp2-zero1": (ParallelConfig(dp=2, tp=2), 1),
    "cp2": (ParallelConfig(cp=2), 0),
    "pp2-zbv": (ParallelConfig(pp=2, microbatches=4, schedule="zbv", virtual_stages=2), 0),  # split backward
    "tp4-2d": (ParallelConfig(tp=4, tp_mode="2d"), 0),  # lora_A and lora_B: two more SUMMA linears
    "tp8-3d": (ParallelConfig(tp=8, tp_mode="3d", microbatches=1), 0),  # lora_A: back to its input layout
}
CASES = [("llama", mode) for mode in MODES if mode not in ("tp4-2d", "tp8-3d")] + [
    ("llama_nopad", "tp4-2d"),  # (2D vocabulary embeddings take no padding_idx)
    ("llama_nopad", "tp8-3d"),
    ("llama_mqa", "tp2"),  # one KV head over tp=2: K/V and their lora_B replicated by heads
    ("llama_head", "tp2-sp"),  # modules_to_save: the head's frozen original and trained copy both split
    ("qwen2", "tp2-sp"),  # roles derived from the module tree, adapters on some projections only
    ("phi3", "tp2"),  # fused q|k|v and gate|up: each lora_B split by the same parts
    ("gpt2", "tp2"),  # Conv1D base layers (fan_in_fan_out)
    ("gpt2", "pp2"),
]


def _parallel(rank: int, family: str, config: Config) -> Run:
    return boosted_run(build(family), TOKENS.first(3), config, sgd(0.5))


@pytest.mark.parametrize(("family", "mode"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_lora_equals_the_serial_peft_run(worker_pools: PoolFactory, family: str, mode: str) -> None:
    parallel, zero = MODES[mode]
    config = oracle_config(parallel, zero, batch_size=8)
    results = worker_pools(config.world_size).run(_parallel, family, config)
    serial = unprefixed(serial_run(build(family), TOKENS.first(3), sgd(0.5)))
    merged = assert_matches_serial(results, serial)
    before = {k.removeprefix(PEFT_PREFIX): v for k, v in build(family).state_dict().items()}
    moved = {n for n, w in merged.items() if not torch.equal(w, before[n])}
    trained = (".lora_", "lm_head.modules_to_save.")
    assert moved and all(any(t in n for t in trained) for n in moved), (
        f"only adapters train: {sorted(moved)[:4]}"
    )


def _verified(rank: int, config: Config) -> Run:
    return boosted_run(build("llama"), TOKENS.first(2), config, sgd(0.5), verify=True)


def test_verify_passes_a_correct_lora_run(worker_pools: PoolFactory) -> None:
    """Verify's serial copy is the PEFT model too: the first step's gradients agree."""
    config = oracle_config(ParallelConfig(tp=2, sequence_parallel=True), 0, batch_size=8)
    results = worker_pools(2).run(_verified, config)
    assert_matches_serial(results, unprefixed(serial_run(build("llama"), TOKENS.first(2), sgd(0.5))))


def _save(rank: int, family: str, config: Config, out: str) -> None:
    model = build(family)
    engine = boost(model, sgd(0.5)(model), config)
    try:
        for ids, targets in TOKENS.first(2):
            engine.train_step(ids, targets)
        engine.save_adapter(Path(out) / "adapter")
        engine.export_merged(Path(out) / "merged")
    finally:
        engine.close()


SAVES = [("llama", "tp2"), ("gpt2", "pp2"), ("llama_head", "dp2-zero3"), ("llama_nopad", "tp8-3d")]


@pytest.mark.parametrize(("family", "mode"), SAVES, ids=[f"{f}-{m}" for f, m in SAVES])
def test_saved_adapters_load_into_peft_and_the_merged_export_into_transformers(
    worker_pools: PoolFactory, tmp_path: Path, family: str, mode: str
) -> None:
    parallel, zero = MODES[mode]
    config = oracle_config(parallel, zero, batch_size=8)
    worker_pools(config.world_size).run(_save, family, config, str(tmp_path))
    serial = build(family)
    optimizer = sgd(0.5)(serial)
    for ids, targets in TOKENS.first(2):
        optimizer.zero_grad()
        F.cross_entropy(serial(ids).logits.flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
    ids = TOKENS.at(7)[0]
    want = serial(ids).logits.detach()
    plain = getattr(transformers, FAMILIES[family][1])(serial.get_base_model().config)
    plain.load_state_dict(  # the same seeded base weights, under the plain model's names
        {
            k.replace(".base_layer.", ".").replace(".original_module.", "."): v
            for k, v in unwrap_peft(build(family)).state_dict().items()
            if "lora_" not in k and ".modules_to_save." not in k
        }
    )
    loaded = peft.PeftModel.from_pretrained(plain, str(tmp_path / "adapter"))
    torch.testing.assert_close(loaded(ids).logits, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"adapter: {m}")
    serial.get_base_model().config.save_pretrained(tmp_path / "merged")
    merged = getattr(transformers, FAMILIES[family][1]).from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(merged(ids).logits, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"merged: {m}")


# ---------------------------------------------------------------- refusals, before any group
def _config(**parallel: Any) -> Config:
    return dataclasses.replace(Config(), parallel=ParallelConfig(**parallel))


def test_dora_under_tp_is_refused_naming_the_layer() -> None:
    model = build("llama", use_dora=True)
    with pytest.raises(ValueError, match=r"q_proj \(colwise\): adapters default are a variant"):
        boost(model, sgd(0.5)(model), _config(tp=2))


def test_adapters_on_a_split_embedding_are_refused_naming_the_layer() -> None:
    model = build("llama", target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match=r"embed_tokens"):
        boost(model, sgd(0.5)(model), _config(tp=2))


def test_prompt_learning_is_refused() -> None:
    config_cls, model_cls, sizes, _ = FAMILIES["llama"]
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**sizes))
    tuned = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match=r"prompt-learning adapters default \(PROMPT_TUNING\)"):
        boost(tuned, sgd(0.5)(tuned), _config(dp=2))


def _drawn_apart(rank: int, config: Config) -> str:
    model = build("llama")
    with torch.no_grad():  # as an unseeded get_peft_model draws them: each rank its own
        model.get_parameter(PEFT_PREFIX + "model.layers.1.self_attn.v_proj.lora_A.default.weight").add_(rank)
    try:
        boost(model, sgd(0.5)(model), config)
    except ValueError as exc:
        return str(exc)
    return "boosted"


def test_adapters_drawn_apart_on_each_rank_are_refused(worker_pools: PoolFactory) -> None:
    config = oracle_config(ParallelConfig(dp=2), 0, batch_size=8)
    for message in worker_pools(2).run(_drawn_apart, config):
        assert "the model differs across ranks before training (1 of " in message, message
        assert "model.layers.1.self_attn.v_proj.lora_A.default.weight" in message
