"""LoRA on mixtures of experts: a PEFT model whose experts, router and shared expert carry
adapters (``target_parameters`` on the stacked expert weights), converted by
``convert_hf_moe`` and trained with expert parallelism.

Tier 0: the converted PEFT model gives the PEFT model's logits, and its adapters' gradients
are PEFT's own mapped to the converted layout (``hf_moe_adapters``); only adapters train.
Tier 2 (the worker pool): Mixtral with adapters on its experts, router and attention, and
Qwen2-MoE with adapters on its shared expert too, trained through ``boost()`` at dp2 x ep2
(ZeRO 1 and 3) and with the experts split over tp under Megatron SP (the ``moe`` style) equal
the serial run of the same converted model; the base weights come back unchanged. DeepSeek-V3
(score-correction bias, groups, a dense first layer), LongCat-Flash (identity experts) and
HunYuan-V3 (``tessera.launcher.testing_hf_moe``'s tiny models) at tier 0 and at dp2 x ep2.

Bounds: logits rtol and atol 1e-5 (PEFT adds the delta to the weight in the same order;
the converted bank runs one batched matmul where HF loops over experts); gradients rtol
1e-5, atol 1e-6. Training as ``tests/test_lora.py``: losses rel 1e-5, weights rtol 1e-5,
atol 1e-6 after 3 SGD steps (momentum: linear in the gradient).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, boost
from tessera.launcher.families import hf_moe_plans as plans
from tessera.launcher.families.adapters import PEFT_PREFIX
from tessera.launcher.families.hf_moe import convert_hf_moe, hf_moe_state_dict
from tessera.launcher.testing import (
    RandomTokens,
    Run,
    assert_matches_serial,
    boosted_run,
    oracle_config,
    serial_run,
    sgd,
)
from tessera.launcher.testing_hf_moe import tiny_moe_model
from tessera.models.foreign_moe import MixConfig, Mixish

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOKENS = RandomTokens(vocab=64, batch=8, seq=8)
_BASE = {
    "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 32,
}  # fmt: skip
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # name: (config class, sizes, LoRA settings)
    "mixtral": (
        "MixtralConfig",
        {**_BASE, "intermediate_size": 12, "num_local_experts": 4, "num_experts_per_tok": 2},
        {"target_modules": ["q_proj", "v_proj"], "target_parameters": ["experts.gate_up_proj",
         "experts.down_proj", "gate.weight"]},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {**_BASE, "intermediate_size": 20, "moe_intermediate_size": 12, "shared_expert_intermediate_size": 8,
         "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True},
        {"target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj"],
         "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]},
    ),
}  # fmt: skip
# further families, as tessera.launcher.testing_hf_moe builds them (hidden 32, 8 experts): DeepSeek-V3
# (a score-correction bias, groups, a shared expert, a dense first layer), LongCat-Flash (identity
# experts beside the real ones), HunYuan-V3 (a renamed shared expert, a router bias)
EXPERTS_LORA = {"target_modules": ["q_b_proj", "o_proj"], "target_parameters": ["experts.gate_up_proj",
                "experts.down_proj", "gate.weight"]}  # fmt: skip
SURVEYED = {
    "deepseek_v3": EXPERTS_LORA,
    "longcat_flash": {**EXPERTS_LORA, "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]},
    "hy_v3": {**EXPERTS_LORA, "target_modules": ["q_proj", "o_proj"]},
}


def build(family: str) -> nn.Module:
    """The family's tiny PEFT model (rank 2, alpha 4), converted; every weight and ``lora_B``
    drawn (HF leaves routers at zero, PEFT its ``lora_B``)."""
    gen = torch.Generator().manual_seed(0)
    if family in SURVEYED:
        base, lora = tiny_moe_model(family), SURVEYED[family]
        torch.manual_seed(0)
    else:
        config_cls, sizes, lora = FAMILIES[family]
        torch.manual_seed(0)  # PEFT draws lora_A from the global generator
        model = getattr(transformers, config_cls)(**sizes)
        base = transformers.AutoModelForCausalLM.from_config(model)
        with torch.no_grad():
            for _, p in sorted(base.named_parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, **lora))
    with torch.no_grad():
        for name, p in sorted(wrapped.named_parameters()):
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return wrapped


def converted(family: str) -> nn.Module:
    model = build(family)
    convert_hf_moe(model)
    return model


def _peft_grads_in_tessera_layout(model: nn.Module) -> dict[str, Tensor]:
    """The PEFT model's expert adapter gradients as the converted layer holds them."""
    out = {}
    for name, module in model.named_modules():
        if not name.endswith(".mlp") or not hasattr(module, "experts"):  # a dense layer's MLP
            continue
        layer: Any = module
        wrapper = layer.experts
        while hasattr(wrapper, "parameter_name"):
            e = wrapper.num_experts
            a, b = wrapper.lora_A["default"].weight.grad, wrapper.lora_B["default"].weight.grad
            down = a.reshape(e, -1, a.shape[-1])
            up = b.reshape(b.shape[0], -1, e).permute(2, 0, 1)
            if wrapper.parameter_name == "gate_up_proj":
                h = up.shape[1] // 2
                out[f"{name}.experts.adapters.default.in.down"] = down
                out[f"{name}.experts.adapters.default.in.up.w1"] = up[:, :h]
                out[f"{name}.experts.adapters.default.in.up.w3"] = up[:, h:]
            else:
                out[f"{name}.experts.adapters.default.out.down"] = down
                out[f"{name}.experts.adapters.default.out.up.w2"] = up
            wrapper = wrapper.base_layer
    return out


@pytest.mark.parametrize("family", [*FAMILIES, *SURVEYED])
def test_the_converted_peft_model_computes_what_peft_computes(family: str) -> None:
    model = build(family)
    ids = TOKENS.at(0)[0]
    want = model(ids).logits
    want.square().mean().backward()
    wanted = _peft_grads_in_tessera_layout(model)
    ours = copy.deepcopy(model)
    ours.zero_grad(set_to_none=True)
    assert convert_hf_moe(ours) >= 1
    got = ours(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"logits: {m}")
    got.square().mean().backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    trained = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert all(".lora_" in n or ".adapters." in n for n in trained), sorted(trained)[:4]
    assert wanted and set(wanted) <= set(grads)
    for name, g in wanted.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


MODES: dict[str, tuple[ParallelConfig, int]] = {
    "dp2-ep2": (ParallelConfig(dp=2, ep=2, microbatches=1), 1),
    "dp2-ep2-zero3": (ParallelConfig(dp=2, ep=2, microbatches=1), 3),
    "tp2-sp-split": (ParallelConfig(tp=2, sequence_parallel=True, microbatches=1), 1),  # experts split inside
}
PLANS = {
    "mixtral": {**plans.MIXTRAL_PLAN.as_dict(), "model.layers.*.mlp": "moe"},
    "qwen2_moe": {**plans.QWEN2_MOE_PLAN.as_dict(), "model.layers.*.mlp": "moe"},
}
CASES = [("mixtral", m) for m in MODES] + [("qwen2_moe", "dp2-ep2-zero3"), ("qwen2_moe", "tp2-sp-split")]
CASES += [("deepseek_v3", "dp2-ep2-zero3"), ("longcat_flash", "dp2-ep2"), ("hy_v3", "dp2-ep2")]


def _parallel(rank: int, family: str, config: Config, split: bool) -> Run:
    return boosted_run(
        converted(family), TOKENS.first(3), config, sgd(0.2), plan=PLANS[family] if split else None
    )


@pytest.mark.parametrize(("family", "mode"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_adapted_experts_train_as_serially(worker_pools: PoolFactory, family: str, mode: str) -> None:
    parallel, zero = MODES[mode]
    config = oracle_config(parallel, zero, batch_size=8)
    results = worker_pools(config.world_size).run(
        _parallel, family, config, mode.endswith("split"), timeout=180
    )
    losses, weights = serial_run(converted(family), TOKENS.first(3), sgd(0.2))
    serial = (losses, {k.removeprefix(PEFT_PREFIX): v for k, v in weights.items()})
    merged = assert_matches_serial(results, serial)
    before = {k.removeprefix(PEFT_PREFIX): v for k, v in converted(family).state_dict().items()}
    moved = {n for n, w in merged.items() if not torch.equal(w, before[n])}
    assert any(".experts.adapters." in n for n in moved), "the experts' adapters train"
    assert all(".lora_" in n or ".adapters." in n for n in moved), f"only adapters train: {sorted(moved)[:4]}"


def _save(rank: int, family: str, config: Config, out: str) -> None:
    model = converted(family)
    engine = boost(model, sgd(0.2)(model), config)
    try:
        for ids, targets in TOKENS.first(2):
            engine.train_step(ids, targets)
        engine.save_adapter(Path(out) / "adapter")
        engine.export_merged(Path(out) / "merged")
    finally:
        engine.close()


def test_adapters_of_experts_save_for_peft_and_merge_into_the_experts(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    """Trained at dp2 x ep2 (ZeRO 3): the adapter file loads into PEFT (its stacked expert
    adapters under PEFT's keys) and the merged export, mapped to transformers' names by
    ``hf_moe_state_dict``, loads into Mixtral; both give the logits of the serial PEFT model
    trained the same 2 steps (rtol 1e-4, atol 1e-5: fp32 through a forward, the merge summed
    in another order)."""
    parallel, zero = MODES["dp2-ep2-zero3"]
    config = oracle_config(parallel, zero, batch_size=8)
    worker_pools(config.world_size).run(_save, "mixtral", config, str(tmp_path), timeout=180)
    serial = build("mixtral")
    optimizer = sgd(0.2)(serial)
    for ids, targets in TOKENS.first(2):
        optimizer.zero_grad()
        F.cross_entropy(serial(ids).logits.flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
    ids = TOKENS.at(7)[0]
    want = serial(ids).logits.detach()
    config_cls, sizes, _ = FAMILIES["mixtral"]
    base = build("mixtral").get_base_model()
    frozen = {k: v for k, v in base.state_dict().items() if "lora_" not in k}
    plain = getattr(transformers, config_cls.replace("Config", "ForCausalLM"))(
        getattr(transformers, config_cls)(**sizes)
    )
    plain.load_state_dict(_plain_names(frozen))
    loaded = peft.PeftModel.from_pretrained(plain, str(tmp_path / "adapter"))
    torch.testing.assert_close(loaded(ids).logits, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"adapter: {m}")
    merged: dict[str, Tensor] = {}
    for shard in sorted((tmp_path / "merged").glob("*.safetensors")):
        merged.update(safetensors.torch.load_file(shard))
    assert not any(".adapters." in k or "lora_" in k for k in merged), "adapters merged, not exported"
    fresh = getattr(transformers, config_cls.replace("Config", "ForCausalLM"))(
        getattr(transformers, config_cls)(**sizes)
    )
    fresh.load_state_dict(hf_moe_state_dict(merged, like=fresh), strict=True)
    torch.testing.assert_close(fresh(ids).logits, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"merged: {m}")


def _plain_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A PEFT base model's state under the plain model's names (``base_layer`` components out)."""
    return {k.replace(".base_layer", ""): v for k, v in state.items()}


# ------------------------------------------------- a user's own mixture, converted by boost()
OWN_TARGETS = ["gate_proj", "up_proj", "down_proj", "gate", "wq"]  # experts, shared expert, router


def build_own() -> nn.Module:
    """``Mixish`` (a plain-PyTorch mixture: router ``gate``, a list of SwiGLU experts, a shared
    expert) wrapped by PEFT with adapters on every projection of the mixture and on ``wq``."""
    torch.manual_seed(0)
    model = Mixish(MixConfig(shared=8), seed=0)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=OWN_TARGETS))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(wrapped.named_parameters()):
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return wrapped


def _own_save(rank: int, config: Config, out: str) -> list[float]:
    model = build_own()
    engine = boost(model, sgd(0.2)(model), config)
    try:
        losses = [engine.train_step(ids, targets).loss for ids, targets in TOKENS.first(3)]
        engine.save_adapter(Path(out) / "adapter")
        engine.export_merged(Path(out) / "merged")
    finally:
        engine.close()
    return losses


def test_a_users_own_mixture_with_adapters_trains_saves_and_merges(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    """``boost()`` converts the PEFT-wrapped mixture itself (each expert's adapters stacked)
    and trains it at dp2 x ep2 (ZeRO 3): the losses equal the serial run of the PEFT model as
    the user wrote it (rel 1e-5); the adapter file loads into PEFT on a fresh ``Mixish`` and the
    merged export loads strictly into one, each giving the serial model's logits (rtol 1e-4,
    atol 1e-5)."""
    parallel, zero = MODES["dp2-ep2-zero3"]
    config = oracle_config(parallel, zero, batch_size=8)
    results = worker_pools(config.world_size).run(_own_save, config, str(tmp_path), timeout=180)
    serial = build_own()
    optimizer = sgd(0.2)(serial)
    losses = []
    for ids, targets in TOKENS.first(3):
        optimizer.zero_grad()
        loss = F.cross_entropy(serial(ids).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    for got in results:
        assert got == pytest.approx(losses, rel=1e-5)
    ids = TOKENS.at(7)[0]
    want = serial(ids).detach()
    loaded = peft.PeftModel.from_pretrained(Mixish(MixConfig(shared=8), seed=0), str(tmp_path / "adapter"))
    torch.testing.assert_close(loaded(ids), want, rtol=1e-4, atol=1e-5, msg=lambda m: f"adapter: {m}")
    merged: dict[str, Tensor] = {}
    for shard in sorted((tmp_path / "merged").glob("*.safetensors")):
        merged.update(safetensors.torch.load_file(shard))
    fresh = Mixish(MixConfig(shared=8), seed=1)
    fresh.load_state_dict(merged, strict=True)
    torch.testing.assert_close(fresh(ids), want, rtol=1e-4, atol=1e-5, msg=lambda m: f"merged: {m}")
