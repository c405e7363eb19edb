"""HF MoE families beyond Mixtral and Qwen2-MoE (built from tiny configs, random weights,
nothing downloaded): Qwen3-MoE, OLMoE, DeepSeek-V2 (group-limited greedy softmax routing,
two shared experts, no query LoRA), DeepSeek-V3 (sigmoid scores, score-correction bias, 4
groups of which 2 kept, routed scale 2.5, a dense first layer, query LoRA), GraniteMoE,
GraniteMoeShared (its shared MLP outside the block), Llama 4 (top-1 sigmoid scores weighing
the experts' inputs, a shared expert, experts laid out by columns, a dense second layer) and
GPT-OSS (a router and experts with biases, a clamped SwiGLU with its limit lowered to 0.5 so
that the clamps act, gate and up columns alternating).

Tier 0: each converted block computes HF's block's outputs and gradients, each converted
model HF's logits, and its weights load back into transformers strictly; PhiMoE choosing one
expert per token is refused before anything changes (its router kept:
``tests/test_hf_moe_kept_router.py``);
``model_spec`` finds each family's plan; every router and block kind still hashes to the forward
of the class it was read from.

Tier 2 (the worker pool): each family trained through ``boost()`` equals its serial run, 3
SGD steps (momentum 0.9). Qwen3-MoE and DeepSeek-V3 at dp=2 x ep=2 (ZeRO 1), dp=2 x ep=2
(ZeRO 3), tp=2 (the mixture replicated; DeepSeek's latent attention split by heads) and pp=2
(1F1B, 2 microbatches; DeepSeek-V3's dense layer and MoE layer on different stages); the
others (Llama 4 and GPT-OSS included) at dp=2 x ep=2 (ZeRO 1),
and besides GraniteMoeShared (its plan) at tp=2 and GraniteMoE (its multipliers in the
pipeline blocks) at pp=2, to keep the file short: every mode runs the same layer code, and
the two families above hold both kinds of router (softmax top-k; sigmoid, bias, groups,
scale). DeepSeek-V2 at tp=2 has its latent attention without query
LoRA (``q_proj`` split by its ``qk_head_dim``-wide heads). Qwen3-MoE also with its experts
split inside over tp (the ``moe`` style; its dense layer split as Llama's MLP) under Megatron
SP, at tp=2 and at dp=2 x ep=2 x tp=2 (ZeRO 3). Every other family that
``tests/survey_hf_moe.py`` converts with the same logits (30 more: the survey's, less these
eight, ``test_hf_moe.py``'s Mixtral and Qwen2-MoE and the 13 of ``test_hf_moe_expert_kinds.py``
and ``test_hf_moe_routing_kinds.py``), built by the survey's own ``build`` (8
experts, top-2, hidden 32; Kimi's linear attention narrowed), at dp=2 x ep=2 (ZeRO 1), one
case each in the same two workers (about 20 s in all here).

With no plan written (``derived_roles.derive_roles``, every layer read): those 29, OLMoE (the
derived roles keep its attention whole: its q_norm spans all heads), Llama 4 and GPT-OSS
at tp=2, each once, with Megatron SP where its plan takes it (``SP_FAMILIES``, which a tier-0
test holds to what the plans say); GLM-4-MoE-Lite (latent attention, a dense first layer) with
SP, Jamba (Mamba mixers kept whole) and GPT-OSS (biases) also at dp=2 x ep=2 x tp=2 (ZeRO 3).
Tier 0: DeepSeek-V3's derived plan names its mixture ``moe`` and its dense first layer an MLP
region, and Jamba's keeps its mixers whole and refuses SP, naming them.

Tolerances: block outputs and gradients fp32 rtol 1e-5, atol 1e-6: the same products, with
HF's ``F.linear`` against a transposed copy and per-expert loops against one batched matmul,
so only the summation order differs (and Granite's softmax over the top-k logits against a
renormalised softmax over all: equal up to round-off). Logits rtol and atol 1e-5 (order 1).
Losses rel 1e-5 and SGD weights rtol 1e-5, atol 1e-6, as in ``test_hf_moe.py``. The random
weights make the routing decisive: a wrong score function, a bias used for weighting, a
group rule or scale left out changes outputs at order 1e-1 or more.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import Tensor, nn

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost, model_spec
from tessera.launcher.families import hf_moe_plans as plans
from tessera.launcher.families.derived_roles import derive_roles
from tessera.launcher.families.hf_moe import convert_hf_moe, hf_moe_state_dict, moe_from_hf
from tessera.launcher.families.hf_moe_kinds import (
    BLOCK_KINDS,
    EXPERTS,
    EXPERTS_COLUMNS,
    EXPERTS_GPT_OSS,
    SHARED_MLP,
    SHARED_MLP_LLAMA4,
    source_key,
)
from tessera.launcher.families.hf_moe_router_kinds import ROUTER_KINDS
from tessera.launcher.testing import RandomTokens, assert_matches_serial, redrawn, serial_run, sgd
from tessera.launcher.testing_hf_moe import assert_weights_load_back, sparse_blocks, tiny_moe_model, token_ids
from tessera.launcher.train.moe_style import MOE_STYLE
from tessera.moe import MoE
from tessera.tensor_parallel import resolve

transformers = pytest.importorskip("transformers", reason="transformers is not installed: HF MoE NOT tested")

TOL = {"rtol": 1e-5, "atol": 1e-6}
VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 4, 3, 0.2
BASE = {
    "vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "max_position_embeddings": 32, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2,
}  # fmt: skip
MLA = {"kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", {
        "intermediate_size": 20, "moe_intermediate_size": 12, "num_experts": 4, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "mlp_only_layers": [1],
    }),
    "olmoe": ("OlmoeConfig", {"intermediate_size": 12, "num_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v2": ("DeepseekV2Config", {
        **MLA, "intermediate_size": 20, "moe_intermediate_size": 12, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "topk_method": "group_limited_greedy",
        "first_k_dense_replace": 0, "n_shared_experts": 2, "routed_scaling_factor": 1.5, "q_lora_rank": None,
    }),
    "deepseek_v3": ("DeepseekV3Config", {
        **MLA, "intermediate_size": 20, "moe_intermediate_size": 12, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
        "n_shared_experts": 1, "routed_scaling_factor": 2.5, "q_lora_rank": 8,
    }),
    "granitemoe": ("GraniteMoeConfig", {
        "intermediate_size": 12, "num_local_experts": 4, "num_experts_per_tok": 2,
    }),
    "granitemoeshared": ("GraniteMoeSharedConfig", {
        "intermediate_size": 12, "num_local_experts": 4, "num_experts_per_tok": 2,
        "shared_intermediate_size": 8,
    }),
    # no shared MLP (shared_intermediate_size = 0): its plan's optional shared_mlp entry matches nothing
    "granitemoeshared-unshared": ("GraniteMoeSharedConfig", {
        "intermediate_size": 12, "num_local_experts": 4, "num_experts_per_tok": 2,
        "shared_intermediate_size": 0,
    }),
    # top-1, as Llama 4 Scout and Maverick; layer 1 dense (moe_layers)
    "llama4_text": ("Llama4TextConfig", {
        "intermediate_size": 12, "intermediate_size_mlp": 20, "num_local_experts": 4,
        "num_experts_per_tok": 1, "head_dim": 4, "moe_layers": [0],
        "attention_chunk_size": 4, "no_rope_layers": [1, 0],  # layer 0 chunked with rope, 1 full without
    }),
    # a small swiglu_limit, so that the clamps act on these weights
    "gpt_oss": ("GptOssConfig", {
        "intermediate_size": 12, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 4,
        "sliding_window": 4, "swiglu_limit": 0.5,
    }),
}  # fmt: skip
FAMILIES = list(CONFIGS)
MOE_BLOCKS = {
    "qwen3_moe": 1,
    "olmoe": 2,
    "deepseek_v2": 2,
    "deepseek_v3": 1,
    "granitemoe": 2,
    "granitemoeshared": 2,
    "granitemoeshared-unshared": 2,
    "llama4_text": 1,
    "gpt_oss": 2,
}


def _config(family: str) -> Any:
    cls, changes = CONFIGS[family]
    return getattr(transformers, cls)(**BASE, **changes)


def _build(family: str) -> nn.Module:
    """The family's tiny model, every parameter and score-correction bias drawn anew from seed
    0 (HF leaves routers and biases at zero, where every expert ties)."""
    return redrawn(transformers.AutoModelForCausalLM.from_config(_config(family)), 0)


# ---------------------------------------------------------------------------- tier 0
@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_block_computes_what_hf_computes(family: str) -> None:
    block: Any = sparse_blocks(_build(family))[0]
    layer = moe_from_hf(block)
    assert layer.capacity_factor is None
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    g = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2))
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = block(x_hf), layer(x_ours)
    if isinstance(want, tuple):  # Llama 4's block: (out [T, d], router_logits), unpacked by its layer
        assert isinstance(got, tuple) and got[1] is None
        want, got = want[0].view(x.shape), got[0]
    torch.testing.assert_close(got, want, **TOL)
    (want * g).sum().backward()
    (got * g).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad, **TOL)
    router = block.router if hasattr(block, "router") else block.gate
    gate_up, down = block.experts.gate_up_proj.grad, block.experts.down_proj.grad
    if family == "llama4_text":  # gate_up [E, d, 2h] (gate columns, then up), down [E, h, d]
        h = gate_up.shape[2] // 2
        gate, up = gate_up[..., :h], gate_up[..., h:]
    elif family == "gpt_oss":  # gate_up [E, d, 2h] (gate and up columns alternating), biases
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
        bias = block.experts.gate_up_proj_bias.grad
        want = {"b1": bias[:, 0::2], "b3": bias[:, 1::2], "b2": block.experts.down_proj_bias.grad}
        for b, grad in want.items():
            torch.testing.assert_close(getattr(layer.experts, b).grad, grad, **TOL)
        torch.testing.assert_close(layer.router.bias.grad, router.bias.grad, **TOL)
    else:  # gate_up [E, 2h, d], down [E, d, h]
        h = gate_up.shape[1] // 2
        gate, up, down = gate_up[:, :h].transpose(1, 2), gate_up[:, h:].transpose(1, 2), down.transpose(1, 2)
    assert layer.experts.w3 is not None and layer.experts.w3.grad is not None
    torch.testing.assert_close(layer.router.weight.grad, router.weight.grad, **TOL)
    torch.testing.assert_close(layer.experts.w1.grad, gate, **TOL)
    torch.testing.assert_close(layer.experts.w3.grad, up, **TOL)
    torch.testing.assert_close(layer.experts.w2.grad, down, **TOL)
    if layer.shared is not None:
        shared = block.shared_expert if family == "llama4_text" else block.shared_experts
        torch.testing.assert_close(layer.shared.w2.grad[0], shared.down_proj.weight.grad.t(), **TOL)


def test_the_moe_styles_shard_specs_name_the_split_of_gpt_osss_biased_experts() -> None:
    """What ``split_hidden`` keeps of each tensor of a converted GPT-OSS block, on either tp
    rank (``keep_hidden`` as the rank's share), is the ``moe`` style's shard of the whole
    tensor; the router's and ``b2`` are whole (``shard_spec`` None)."""
    whole = moe_from_hf(sparse_blocks(_build("gpt_oss"))[0])
    specs = {n: MOE_STYLE.shard_spec(whole, n) for n, _ in whole.named_parameters()}
    assert {n for n, spec in specs.items() if spec is None} == {"router.weight", "router.bias", "experts.b2"}
    for rank in (0, 1):
        share = copy.deepcopy(whole)
        h = share.experts.hidden // 2
        share.experts.keep_hidden(rank * h, (rank + 1) * h)
        assert share.experts.out_bias_share == (1.0 if rank == 0 else 0.0)
        for name, p in whole.named_parameters():
            spec = specs[name]
            want = p if spec is None else p.chunk(2, dim=spec.dim)[rank]
            torch.testing.assert_close(share.get_parameter(name), want, rtol=0, atol=0)


def test_deepseek_v3s_bias_is_a_buffer_that_chooses() -> None:
    """The score-correction bias is the router's buffer (loaded, not trained), and it matters:
    the converted block without it routes differently."""
    block: Any = sparse_blocks(_build("deepseek_v3"))[0]
    layer = moe_from_hf(block)
    assert layer.router.score_bias is not None
    assert "router.score_bias" in dict(layer.named_buffers())
    assert "router.score_bias" not in dict(layer.named_parameters())
    torch.testing.assert_close(layer.router.score_bias, block.gate.e_score_correction_bias, rtol=0, atol=0)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    with_bias = layer.router(x).choices.sort(dim=-1).values
    layer.router.score_bias.zero_()
    assert not torch.equal(layer.router(x).choices.sort(dim=-1).values, with_bias)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_model_gives_the_same_logits(family: str) -> None:
    model = _build(family)
    converted = copy.deepcopy(model)
    assert convert_hf_moe(converted) == MOE_BLOCKS[family]
    assert not sparse_blocks(converted) and any(isinstance(m, MoE) for m in converted.modules())
    if family == "deepseek_v3":  # first_k_dense_replace=1: layer 0 stays dense
        assert type(converted.model.layers[0].mlp).__name__ == "DeepseekV3MLP"
    torch.testing.assert_close(
        converted(token_ids(3)).logits, model(token_ids(3)).logits, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_models_weights_load_back_into_transformers(family: str) -> None:
    converted = _build(family)
    convert_hf_moe(converted)
    with torch.no_grad():  # weights of its own, so a load that kept the old ones would show
        for p in converted.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
        for name, b in converted.named_buffers():
            if name.endswith("score_bias"):
                b.add_(0.05)
    fresh = _build(family)
    fresh.load_state_dict(hf_moe_state_dict(converted.state_dict(), like=fresh), strict=True)
    torch.testing.assert_close(
        fresh(token_ids(4)).logits, converted(token_ids(4)).logits, rtol=1e-5, atol=1e-5
    )


def test_phimoe_choosing_one_expert_is_refused_naming_it_before_anything_changes() -> None:
    """PhiMoE converts with its router kept (``tests/test_hf_moe_kept_router.py``), but not with
    one expert per token: its sparsemixer always chooses 2."""
    config = transformers.PhimoeConfig(
        **BASE, intermediate_size=12, num_local_experts=4, num_experts_per_tok=1
    )
    model = transformers.PhimoeForCausalLM(config)
    with pytest.raises(ValueError, match=r"PhimoeSparseMoeBlock: top_k=1: the sparsemixer chooses 2 experts"):
        convert_hf_moe(model)
    assert len(sparse_blocks(model)) == 2  # nothing swapped


def test_model_spec_finds_each_familys_plan() -> None:
    want = {
        "qwen3_moe": plans.QWEN3_MOE_PLAN,
        "deepseek_v2": plans.DEEPSEEK_PLAN,
        "deepseek_v3": plans.DEEPSEEK_PLAN,
        "granitemoe": plans.GRANITEMOE_PLAN,
        "granitemoeshared": plans.GRANITEMOE_SHARED_PLAN,
    }
    for family, plan in want.items():
        assert model_spec(_build(family)).roles is plan
        assert (
            plan.as_dict()[next(p for p in plan.as_dict() if p.endswith(("mlp", "moe")))].name == "replicate"
        )
    # OLMoE: no plan, no refusal; the derived roles keep its attention whole (q_norm spans all heads)
    olmoe = model_spec(_build("olmoe"))
    assert olmoe.roles is None and not olmoe.refuses


def _transformers_class(like: str) -> type:
    model, cls = like.split(".")
    return getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), cls)  # type: ignore[no-any-return]


KEYS = [(k.like, k.key) for k in (*ROUTER_KINDS, *BLOCK_KINDS)] + [EXPERTS, EXPERTS_COLUMNS, EXPERTS_GPT_OSS]
KEYS += [SHARED_MLP, SHARED_MLP_LLAMA4]


@pytest.mark.parametrize(("like", "key"), KEYS, ids=[like for like, _ in KEYS])
def test_every_kind_still_reads_the_forward_it_was_written_for(like: str, key: str) -> None:
    """A new transformers whose forward changed fails here, naming the class to read again."""
    assert source_key(getattr(_transformers_class(like), "forward")) == key  # noqa: B009


# ---------------------------------------------------------------------------- tier 2
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)


Run = tuple[list[float], dict[str, Tensor]]


def _converted(family: str) -> nn.Module:
    model = _build(family) if family in CONFIGS else _survey_model(family)
    convert_hf_moe(model)
    return model


def _serial(family: str) -> Run:
    return serial_run(_converted(family), TOKENS.first(STEPS), sgd(LR))


def _parallel(rank: int, config: Config, family: str, plan: Any = None, spec: Any = None) -> Run:
    model = _converted(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine = boost(model, optimizer, config, plan=plan, spec=spec)
    losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
    weights = engine.full_state_dict()  # at ep > 1 each expert bank gathered over the ep group
    engine.mesh.close()
    return losses, weights


MODES: dict[str, Callable[[], tuple[ParallelConfig, int]]] = {
    "ep2": lambda: (ParallelConfig(dp=2, ep=2, microbatches=1), 1),
    "ep2-zero3": lambda: (ParallelConfig(dp=2, ep=2, microbatches=1), 3),
    "tp2": lambda: (ParallelConfig(tp=2, microbatches=1), 0),
    "pp2": lambda: (ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1),
    # every expert split inside over tp (the ``moe`` style), with Megatron SP and ep around it
    "tp2-sp-split": lambda: (ParallelConfig(tp=2, sequence_parallel=True, microbatches=1), 1),
    "dp2-ep2-tp2-sp-split": lambda: (
        ParallelConfig(dp=2, ep=2, tp=2, sequence_parallel=True, microbatches=1),
        3,
    ),
    # the derived roles (``derived_roles``): every mixture split inside over tp
    "tp2-sp": lambda: (ParallelConfig(tp=2, sequence_parallel=True, microbatches=1), 0),
    "dp2-ep2-tp2": lambda: (ParallelConfig(dp=2, ep=2, tp=2, microbatches=1), 3),
    "dp2-ep2-tp2-sp": lambda: (ParallelConfig(dp=2, ep=2, tp=2, sequence_parallel=True, microbatches=1), 3),
}


def _boost_config(mode: str) -> Config:
    """The run of ``mode`` (`MODES`) comparable with `serial_run`: fp32, no clipping."""
    parallel, zero = MODES[mode]()
    c = Config(parallel=parallel, zero=ZeroConfig(stage=zero), train=TrainConfig(precision="fp32"))
    return dataclasses.replace(c, optim=dataclasses.replace(c.optim, clip_grad_norm=0.0))


# the tiny Qwen3-MoE: layer 0 a mixture, split inside over tp; layer 1 dense, split as Llama's MLP
SPLIT = {
    **{k: v for k, v in plans.QWEN3_MOE_PLAN.as_dict().items() if k != "model.layers.*.mlp"},
    "model.layers.0.mlp": "moe",
    "model.layers.1.mlp": "region",
    "model.layers.1.mlp.gate_proj": "colwise",
    "model.layers.1.mlp.up_proj": "colwise",
    "model.layers.1.mlp.down_proj": "rowwise",
}
CASES = [
    *[(f, m) for f in ("deepseek_v3", "qwen3_moe") for m in ("ep2", "ep2-zero3", "tp2", "pp2")],
    ("qwen3_moe", "tp2-sp-split"),
    ("qwen3_moe", "dp2-ep2-tp2-sp-split"),
    *[
        (f, "ep2")
        for f in ("olmoe", "deepseek_v2", "granitemoe", "granitemoeshared", "llama4_text", "gpt_oss")
    ],
    ("deepseek_v2", "tp2"),  # a latent attention without query LoRA: q_proj split by its qk heads
    ("granitemoeshared", "tp2"),  # GRANITEMOE_SHARED_PLAN: block_sparse_moe and shared_mlp replicated
    ("granitemoeshared-unshared", "tp2"),  # the same plan, its optional shared_mlp entry unmatched
    ("granitemoe", "pp2"),  # decoder_blocks apply Granite's embedding and logits multipliers
    ("llama4_text", "pp2"),  # its base under ``model`` (not its base_model_prefix); chunked attention
]


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_a_converted_family_trains_through_boost_as_serially(
    worker_pools: PoolFactory, family: str, mode: str
) -> None:
    config = _boost_config(mode)
    plan = SPLIT if mode.endswith("split") else None
    results = worker_pools(config.world_size).run(_parallel, config, family, plan, timeout=180)
    assert_matches_serial(results, _serial(family))  # each rank: its pipeline stages' weights


def _train_and_consolidate(rank: int, config: Config, family: str, path: str) -> None:
    model = _converted(family)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config)
    for step in range(STEPS):
        engine.train_step(*TOKENS.at(step))
    engine.consolidate(path)
    engine.close()


def test_a_deepseek_v3_trained_at_ep2_loads_into_transformers(
    worker_pools: PoolFactory, tmp_path: Path
) -> None:
    """dp=2 x ep=2, consolidated (router weights, score-correction biases, expert banks
    gathered), mapped back to HF names, loaded strictly into a fresh ``DeepseekV3ForCausalLM``:
    its logits are the serially trained model's."""
    config = _boost_config("ep2")
    path = str(tmp_path / "model.safetensors")
    worker_pools(config.world_size).run(_train_and_consolidate, config, "deepseek_v3", path, timeout=180)
    fresh = transformers.AutoModelForCausalLM.from_config(_config("deepseek_v3"))
    fresh.load_state_dict(hf_moe_state_dict(safetensors.torch.load_file(path), like=fresh), strict=True)
    trained = _converted("deepseek_v3")
    trained.load_state_dict(_serial("deepseek_v3")[1], strict=False)  # the parameters; the biases are HF's
    torch.testing.assert_close(
        fresh(token_ids(99)).logits, trained(token_ids(99)).logits, rtol=1e-5, atol=1e-5
    )


# ------------------------------------------------------- tier 2: every other family that converts
# the families tests/survey_hf_moe.py converts with the same logits, besides CONFIGS' eight,
# test_hf_moe.py's Mixtral and Qwen2-MoE, and PhiMoE and ZAYA (tests/test_hf_moe_kept_router.py)
MORE = [
    "afmoe", "cohere2_moe", "deepseek_v32", "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint",
    "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "granitemoe_swa", "granitemoehybrid", "hunyuan_v1_moe",
    "hy_v3", "jamba", "kimi_linear", "laguna", "lara_mini", "mellum", "mimo_v2_flash", "minicpm5_moe",
    "kolibri1_1",  # tests/test_hf_moe_reach.py holds dots3 Note (refused tp) and Qwen4-Exp (a wider atol)
    "minimax", "minimax_m2", "param2moe", "qwen3_5_moe_text", "qwen3_next", "sarvam_mla", "sarvam_moe",
    "solar_open",
]  # fmt: skip


def _survey_model(family: str) -> nn.Module:
    model: nn.Module = tiny_moe_model(family)
    model.config.use_cache = False  # a hybrid's cache (Jamba's, Granite's) sizes masks from attention layers
    return model


# pp=2 for these is trained in tests/test_hf_hybrid_pp.py, beside variants whose features act at
# these sizes: hybrids whose layers are not all attention layers (Mamba, linear attention),
# GraniteMoE-SWA (a rotary module per base frequency) and the DSA models (their indexer reads the
# causal mask)
NO_PP = {
    "granitemoehybrid", "granitemoe_swa", "jamba", "lara_mini", "qwen3_5_moe_text", "qwen3_next",
    "deepseek_v32", "glm_moe_dsa",
}  # fmt: skip
MORE_CASES = [(f, m) for f in MORE for m in ("ep2", "ep2-zero3")] + [
    (f, "pp2") for f in MORE if f not in NO_PP
]


@pytest.mark.parametrize("family", MORE)
def test_every_other_family_converted_gives_transformers_logits(family: str) -> None:
    """What the survey reports for each of them, held by a test: the converted model's logits are
    the unconverted model's (in training mode, as it trains; dropouts are 0), rtol and atol 1e-5
    (logits of order 1; per-expert loops against one batched matmul: the summation order only).
    A score function, bias, group rule, scale or renormalisation read wrong moves them by 1e-1."""
    model = _survey_model(family)
    converted = copy.deepcopy(model)
    assert convert_hf_moe(converted) >= 1
    ids = token_ids(3)
    torch.testing.assert_close(converted(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", MORE)
def test_every_other_familys_converted_weights_load_back_into_transformers(family: str) -> None:
    """``hf_moe_state_dict`` joins each converted layer's tensors back into its block's (ERNIE's
    score bias in its ``[1, E]``), which a fresh model loads strictly and then gives the converted
    model's logits (rtol and atol 1e-5, as above)."""
    assert_weights_load_back(lambda: _survey_model(family))


@pytest.mark.parametrize(("family", "mode"), MORE_CASES)
def test_every_other_converting_family_trains_at_ep2_as_serially(
    worker_pools: PoolFactory, family: str, mode: str
) -> None:
    """The survey's tiny model of ``family`` (8 experts, top-2; hidden 32), converted, trained
    at dp=2 x ep=2 (ZeRO 1, and ZeRO 3: each expert bank sharded over the edp group and gathered
    for each call) and at pp=2 (1F1B, 2 microbatches): each rank's losses and gathered weights
    are the serial run's."""
    assert any(isinstance(m, MoE) for m in _converted(family).modules())  # what it claims to train
    config = _boost_config(mode)
    results = worker_pools(config.world_size).run(_parallel, config, family, None, timeout=180)
    assert_matches_serial(results, _serial(family))  # each rank: its pipeline stages' weights


# ------------------------------------------------------- tier 2: tp=2 with the roles derived
# the families whose derived plan splits every sublayer, so takes Megatron sequence parallelism;
# the others keep a sublayer whole (a Mamba mixer, a linear attention, attention sinks, an
# attention with a gated query or a norm over all its heads) and refuse it
SP_FAMILIES = [
    "afmoe", "cohere2_moe", "deepseek_v32", "dots1", "ernie4_5_moe", "exaone_moe", "glm4_moe",
    "glm4_moe_lite", "glm_moe_dsa", "hunyuan_v1_moe", "hy_v3", "laguna", "mellum", "minicpm5_moe",
    "param2moe", "sarvam_mla", "sarvam_moe", "solar_open", "llama4_text",
]  # fmt: skip
DERIVED = [*MORE, "olmoe", "llama4_text", "gpt_oss"]
# one case a family: with SP where its plan takes it (the same split, its sequence sharded)
DERIVED_CASES = [
    *[(f, "tp2-sp" if f in SP_FAMILIES else "tp2") for f in DERIVED],
    ("glm4_moe_lite", "dp2-ep2-tp2-sp"),  # latent attention, a dense first layer, a shared expert
    ("jamba", "dp2-ep2-tp2"),  # a hybrid: Mamba mixers kept whole, a dense layer and a mixture
    ("gpt_oss", "dp2-ep2-tp2"),  # router and expert biases (b2 whole, partial over tp), sinks
]


def test_the_derived_plan_of_a_mixed_model_names_each_layers_kind() -> None:
    """DeepSeek-V3 with a dense first layer: its mixture is ``moe`` and its dense MLP a region, each
    under its own layer's name; the latent attention every layer shares is one pattern, with only
    its per-head projections split; nothing is kept whole, so it takes SP."""
    plan = derive_roles(_converted("deepseek_v3"))
    roles = {pattern: style.name for pattern, style in plan.entries}
    want = {
        "model.layers.0.mlp": "region",
        "model.layers.0.mlp.gate_proj": "colwise",
        "model.layers.0.mlp.up_proj": "colwise",
        "model.layers.0.mlp.down_proj": "rowwise",
        "model.layers.1.mlp": "moe",
        "model.layers.*.self_attn": "attention",
        "model.layers.*.self_attn.q_b_proj": "colwise",
        "model.layers.*.self_attn.kv_b_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
    }
    assert {k: roles.get(k) for k in want} == want
    assert "model.layers.*.mlp" not in roles and "model.layers.*.self_attn.q_a_proj" not in roles
    assert "replicate" not in roles.values() and plan.supports_sequence_parallel
    resolve(_converted("deepseek_v3"), plan, tp=2, sequence_parallel=True)


def test_a_hybrids_derived_plan_keeps_its_mamba_mixers_whole_and_refuses_sp() -> None:
    """Jamba (both layers Mamba; layer 0 a dense MLP, layer 1 a mixture): the mixers hold a
    convolution and ``A_log``, which the derived roles do not split: kept whole, so sequence
    parallelism is refused, naming them."""
    model = _converted("jamba")
    plan = derive_roles(model)
    roles = {pattern: style.name for pattern, style in plan.entries}
    assert roles["model.layers.*.mamba"] == "replicate"
    assert roles["model.layers.0.feed_forward"] == "region" and roles["model.layers.1.feed_forward"] == "moe"
    assert not plan.supports_sequence_parallel
    resolve(model, plan, tp=2)
    with pytest.raises(ValueError, match=r"keeps model\.layers\.\*\.mamba whole .* sequence parallelism"):
        resolve(model, plan, tp=2, sequence_parallel=True)


def test_sp_families_lists_the_derived_plans_that_take_sequence_parallelism() -> None:
    """``SP_FAMILIES`` is what the derived plans say, not a list kept by hand apart from them."""
    takes = [f for f in DERIVED if derive_roles(_converted(f)).supports_sequence_parallel]
    assert takes == [f for f in DERIVED if f in SP_FAMILIES]


@pytest.mark.parametrize(("family", "mode"), DERIVED_CASES)
def test_every_converting_family_trains_at_tp2_with_derived_roles_as_serially(
    worker_pools: PoolFactory, family: str, mode: str
) -> None:
    """No plan written: ``derive_roles`` reads every layer of the converted model, giving each
    mixture the ``moe`` style (its experts split inside over tp), splitting attention and dense
    MLPs by heads and hidden units and keeping the rest whole. Trained at tp=2 (and with SP
    where the plan takes it; a few families at dp=2 x ep=2 x tp=2, ZeRO 3), each rank's losses
    and gathered weights are the serial run's."""
    config = _boost_config(mode)
    results = worker_pools(config.world_size).run(_parallel, config, family, None, timeout=180)
    assert_matches_serial(results, _serial(family))
