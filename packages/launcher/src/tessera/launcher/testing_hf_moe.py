"""A tiny model of every mixture-of-experts causal-LM family of the installed ``transformers``,
for tests and the survey (``tests/survey_hf_moe.py``): the tests of the HF MoE conversion and
of its parallel training all build their models here.

`tiny_moe_model` builds a family from its config class with 2 layers, hidden 32, 4 heads,
vocabulary 64, 8 experts of width 16, top-2, 4 groups of which 2 kept where it groups them,
small latent-attention ranks and linear-attention heads, dropouts 0; then every parameter is
drawn from a seeded normal (std 0.3) and every floating buffer named like a bias (a router's
score-correction bias) from another (std 0.1): HF initialises routers and those biases to
zero, where every expert ties. The checks every converted family takes at tier 0 are here too
(`assert_converts_with_the_same_logits`, `assert_weights_load_back`,
`assert_export_parts_are_transformers_tensors`). Nothing here imports pytest.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from tessera.launcher.checkpoint.exported import assemble, found_parts, parts_of
from tessera.launcher.checkpoint.placement import persistent_buffers
from tessera.launcher.families.hf_moe import (
    convert_hf_moe,
    hf_moe_conversion,
    hf_moe_state_dict,
    is_hf_sparse_moe,
)

__all__ = [
    "COMMON",
    "EXPERT_COUNTS",
    "FIXES",
    "MOE",
    "assert_converts_with_the_same_logits",
    "assert_export_parts_are_transformers_tensors",
    "assert_weights_load_back",
    "moe_families",
    "sparse_blocks",
    "tiny_moe_class",
    "tiny_moe_config",
    "tiny_moe_model",
    "token_ids",
]

COMMON: dict[str, Any] = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}  # fmt: skip
"""Every family's sizes (a family whose config has its own names takes only `FIXES`')."""

MOE: dict[str, Any] = {
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "top_k": 2, "moe_intermediate_size": 16,
    "expert_interval": 1, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
    "topk_method": "group_limited_greedy", "n_shared_experts": 1, "shared_expert_intermediate_size": 16,
    "q_lora_rank": 8, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4,
    # Kimi's linear attention: its default 32 heads of width 128 cost seconds per step here
    "linear_head_dim": 8, "linear_num_heads": 2,
}  # fmt: skip
"""The mixture's settings, each passed to the configs that have it."""

FIXES: dict[str, dict[str, Any]] = {  # what a family's config validation needs at these sizes
    "bamba": {"mamba_n_heads": 8, "mamba_d_head": 8},
    "granitemoehybrid": {"mamba_n_heads": 8, "mamba_d_head": 8},
    # Kolibri 1.1: head_dim a multiple of 16 (its NVFP4 rounding), at most heads / kv heads
    # indexer heads, layer 0 dense (its default: the first two, leaving no mixture); its indexed
    # layer's pool of 4 keys (blocks of 2) and top 2, 1 sink and 2 local keys, so that it selects
    "kolibri1_1": {
        "head_dim": 16, "index_num_heads": 2, "mlp_only_layers": [0], "mlp_only_intermediate_size": 64,
        "index_pool_size": 4, "index_compression": 2, "index_topk": 2, "index_num_sink_tokens": 1,
        "index_num_local_tokens": 2,
    },
    # Qwen4-Exp: the token indexer of its indexed attention (which needs all five sizes; a budget
    # of 4 of 8 tokens, so that it selects) and small linear-attention heads
    "qwen4_exp_text": {
        "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
        "indexer_compress_ratio": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "hc_lowrank": 8,
    },
    # dots3 Note: its sliding layers' own latent-attention sizes (swa_*, per layer) and its DSA
    # indexer's, a top-4 of 8 tokens so that it selects
    "dots3_note_text": {
        "shared_experts_intermediate_size": 16, "index_head_dim": 8, "index_n_heads": 2, "index_topk": 4,
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 8,
        "swa_kv_lora_rank": 8, "swa_head_dim": 8, "swa_qk_nope_head_dim": 4, "swa_v_head_dim": 4,
        "sliding_window": 4,
    },
    # Gemma 4's mixture is off unless enable_moe_block; its full-attention layers' head_dim
    # (global_head_dim, default 512) and its per-layer embeddings (default 262144 x 256) made small
    "gemma4_text": {
        "enable_moe_block": True, "top_k_experts": 2, "head_dim": 8, "global_head_dim": 8,
        "vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 4,
    },
    # Doge's product-key mixture is off unless is_moe; 16 experts: a square, 4 x 4 product keys
    "doge": {"is_moe": True, "num_experts": 16},
    "lfm2_moe": {"num_dense_layers": 1, "layer_types": ["conv", "full_attention"]},
    "longcat_flash": {"zero_expert_num": 4},  # its default 256 identity experts beside 8 real ones
    "zaya": {"num_experts_per_tok": 1},
    # Ergo: its shared expert's and its dense first layer's own widths (defaults 8192 and 32768)
    "ergo": {"shared_intermediate_size": 16, "first_dense_intermediate_size": 64},
    # Inkling: its sliding layers' own heads (default 64 of width 128), a short relative-logit
    # window, two shared experts (its default), each weighed by the router, and a window of 4
    # tokens (its sliding layers then mask other keys than its full ones)
    "inkling_text": {
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8, "rel_extent": 16,
        "n_shared_experts": 2, "sliding_window": 4,
    },
    # their mixtures are off unless switched on: Beam's by its layer kinds, Flint's by its sparse step
    "beam": {"mlp_layer_types": ["dense", "sparse"]},
    # DeepSeek-V4: a hash layer (experts by token id) and a top-k one (its default: 3 hash layers
    # first), and a SwiGLU limit its clamps reach on these weights (its default 10 they never do)
    "deepseek_v4": {"mlp_layer_types": ["hash_moe", "moe"], "swiglu_limit": 1.0},
    "flint": {"decoder_sparse_step": 1, "mlp_only_layers": []},
    "dbrx": {
        "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 64,
        # clip_qkv: HF's attention clamps by it, and fails with None
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"moe_num_experts": 8, "moe_top_k": 2, "ffn_hidden_size": 16},
    },
}  # fmt: skip
"""Per family, config entries passed whether or not its default config has them."""


def tiny_moe_config(
    kind: str, changes: Mapping[str, Any] | None = None, *, settings: Mapping[str, Any] | None = None
) -> Any:
    """The tiny config of the ``transformers`` model type ``kind``, dropouts 0. ``changes``:
    config entries of this call, passed as `FIXES`' are (beside the family's own);
    ``settings``: entries merged into `MOE`, passed where the config has them."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[kind]()
    moe = {**MOE, **(settings or {})}
    own = FIXES.get(kind)
    if changes:
        own = {**(own if own is not None else {**COMMON, **moe}), **changes}
    wanted = {**COMMON, **moe, **(own or {})}
    if _has(defaults, "kv_lora_rank"):  # latent attention: a key per query head, rotary width 4
        wanted |= {"num_key_value_heads": COMMON["num_attention_heads"], "head_dim": moe["qk_rope_head_dim"]}
    types = vars(defaults).get("layer_types")
    if isinstance(types, list) and "layer_types" not in wanted:  # the first two kinds of layer
        kinds = list(dict.fromkeys(types))
        wanted["layer_types"] = (kinds * 2)[:2]
    forced = own if own is not None else COMMON  # a config of its own names takes only those
    config = CONFIG_MAPPING[kind](**{k: v for k, v in wanted.items() if k in forced or _has(defaults, k)})
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def _has(config: Any, name: str) -> bool:
    """Whether ``config`` has ``name``; one kept per layer (dots3 Note's ``kv_lora_rank``) counts."""
    try:
        return hasattr(config, name)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return name in vars(config)


def tiny_moe_class(kind: str) -> type[nn.Module]:
    """The causal-LM class of the ``transformers`` model type ``kind``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls: type[nn.Module] = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind])
    return cls


def tiny_moe_model(
    kind: str,
    changes: Mapping[str, Any] | None = None,
    *,
    settings: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> nn.Module:
    """The tiny causal LM of `tiny_moe_config` (its weights drawn from ``seed``)."""
    model: nn.Module = tiny_moe_class(kind)(tiny_moe_config(kind, changes, settings=settings))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for name, b in sorted(model.named_buffers()):
            if "bias" in name and b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


EXPERT_COUNTS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_routed_experts",
)
"""The config attributes that count a family's experts (DBRX's sit in its ``ffn_config``)."""


def moe_families() -> list[str]:
    """The model types of the installed ``transformers`` whose causal LM is a mixture of experts
    (its default config counts experts, `EXPERT_COUNTS`, or has DBRX's ``ffn_config``), sorted;
    a config that does not build with its defaults is left out."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kinds = []
    for kind, cls in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        try:
            config = CONFIG_MAPPING[kind]()
        except Exception:  # a config that does not build with its defaults is not a family here
            continue
        if cls.endswith("ForCausalLM") and any(hasattr(config, n) for n in (*EXPERT_COUNTS, "ffn_config")):
            kinds.append(kind)
    return kinds


def sparse_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse MoE blocks of an HF model that ``convert_hf_moe`` would convert or refuse."""
    return [m for m in model.modules() if is_hf_sparse_moe(m)]


def token_ids(seed: int, *, vocab: int = COMMON["vocab_size"], batch: int = 2, seq: int = 8) -> Tensor:
    """``batch`` rows of ``seq`` token ids drawn from ``seed``."""
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def assert_converts_with_the_same_logits(model: nn.Module) -> None:
    """``convert_hf_moe`` on a copy of ``model`` converts its sparse blocks, every one, and the
    converted model gives ``model``'s logits (rtol and atol 1e-5: logits of order 1, the same
    products summed in another order)."""
    converted = copy.deepcopy(model)
    assert convert_hf_moe(converted) >= 1
    assert not sparse_blocks(converted)
    want: Any = model(token_ids(3))
    got: Any = converted(token_ids(3))
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def assert_weights_load_back(build: Callable[[], nn.Module]) -> None:
    """A converted model of ``build()`` given weights of its own, mapped back to transformers'
    names (``hf_moe_state_dict``), loads strictly into a fresh ``build()``, which then gives the
    converted model's logits (rtol and atol 1e-5)."""
    converted = build()
    convert_hf_moe(converted)
    with torch.no_grad():  # weights of its own, so a load that kept the old ones would show
        for p in converted.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
        for name, b in converted.named_buffers():
            if name.endswith("score_bias"):
                b.add_(0.05)
    fresh = build()
    fresh.load_state_dict(hf_moe_state_dict(converted.state_dict(), like=fresh), strict=True)
    want: Any = converted(token_ids(4))
    got: Any = fresh(token_ids(4))
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def assert_export_parts_are_transformers_tensors(model: nn.Module) -> None:
    """What ``boost()`` exports, consolidates and imports by (``hf_moe_conversion``'s parts): each
    converted parameter and persistent buffer of ``model`` assembled from transformers' tensors is
    itself (``torch.equal``: copies, slices, transposes), and the parameters' parts name every
    parameter of the HF model."""
    hf = {k: v.detach() for k, v in model.state_dict().items()}
    converted = copy.deepcopy(model)
    conversion = hf_moe_conversion(converted)
    tensors = {**dict(converted.named_parameters()), **persistent_buffers(converted)}
    named: set[str] = set()
    for name, value in tensors.items():
        parts = found_parts(parts_of(name, conversion.exported), hf.__contains__)
        assert parts is not None, name
        assert torch.equal(assemble(parts, [hf[p.name] for p in parts]), value.detach()), name
        named |= {p.name for p in parts}
    missing = {n for n, _ in model.named_parameters()} - named
    assert not missing, sorted(missing)
