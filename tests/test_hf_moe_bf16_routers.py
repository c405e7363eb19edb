"""In bf16, a converted HF mixture's router computes the logits transformers' router computes.

Many HF routers compute their logits in fp32 whatever the model's dtype (DeepSeek-V3's
``F.linear(x.float(), weight.float())`` and the families generated from it, ERNIE, Flint,
Kolibri, LongCat-Flash, Ergo, Inkling, Beam, ...); the others in the model's dtype (Mixtral,
Qwen, OLMoE, ...; some cast bf16 logits up afterwards, Granite, Laguna). A converted router that
computed bf16 logits where HF computes fp32 ones would round them to 8 significant bits and
choose other experts for the tokens whose scores are that close: a bf16 run would then train
another model than transformers' own. Each router kind says which it is
(``hf_moe_router_kinds``: ``float32``, `tessera.moe.RouterSpec`'s ``float32``).

Tier 0: for every converting family (`tessera.launcher.testing_hf_moe`'s tiny models, cast to
bf16 whole), the converted router's logits of 64 bf16 tokens are HF's router's logits exactly
(``torch.equal``: both the same fp32 product of the same bf16 values, or the same bf16 product),
in HF's dtype or computed as HF computes them and then cast up by HF (Granite's ``.float()``).
The families whose HF router does not return its logits first (Llama 4: its scores; JetMoE: its
choices; AFMoE: its weights) or cannot run in bf16 at all (Inkling 2 keeps its router's weight
in fp32: ``_keep_in_fp32_modules_strict``) are not listed; their kinds' forwards are read by
``tests/test_hf_moe_families.py``'s source-key test.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch

from tessera.launcher.families.hf_moe import moe_from_hf
from tessera.launcher.families.hf_moe_export import block_tensor
from tessera.launcher.families.hf_moe_kinds import BLOCK_KINDS, source_key
from tessera.launcher.families.hf_moe_routing import read_layout
from tessera.launcher.testing_hf_moe import sparse_blocks, tiny_moe_model

pytest.importorskip("transformers", reason="transformers is not installed: HF routers NOT tested")

FAMILIES = [
    "aria_text", "axk1", "axk2", "cohere2_moe", "dbrx", "deepseek_v2", "deepseek_v3", "deepseek_v32",
    "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa",
    "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe",
    "hy_v3", "hy_v4", "jamba", "kolibri1", "laguna", "lfm2_moe", "longcat_flash", "mellum",
    "mimo_v2_flash", "minicpm5_moe", "minimax", "minimax_m2", "minimax_m3_vl_text", "mixtral", "nemotron_h",
    "olmoe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "sarvam_mla", "solar_open",
    "bailing_hybrid", "kimi_linear", "lara_mini", "param2moe", "sarvam_moe",
    "ergo", "inkling_text", "beam", "kolibri1_1", "qwen4_exp_text", "dots3_note_text",
]  # fmt: skip


def _hf_logits(block: Any, x: torch.Tensor) -> torch.Tensor:
    """HF's router of ``block`` on tokens ``x``: its first output (given the block's choice bias
    where its forward takes it: HunYuan-V3's, MiniMax-M2's, LFM2's)."""
    kind = next(k for k in BLOCK_KINDS if k.key == source_key(type(block).forward))
    router = getattr(block, kind.router)
    layout = read_layout(block)
    takes_bias = len(inspect.signature(router.forward).parameters) > 1
    extra = [block_tensor(block, layout.score_bias)] if takes_bias and layout.score_bias else []
    out = router(x, *extra)
    return out if isinstance(out, torch.Tensor) else out[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_converted_router_computes_transformers_logits_in_bf16(family: str) -> None:
    block = copy.deepcopy(sparse_blocks(tiny_moe_model(family))[0]).to(torch.bfloat16)
    layer = moe_from_hf(block)
    x = torch.randn(64, layer.router.weight.shape[1], generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        want, got = _hf_logits(block, x), layer.router(x).logits
    assert got.dtype in (want.dtype, torch.bfloat16), (got.dtype, want.dtype)
    # bit for bit: a bf16 product where HF keeps fp32 differs in the 3rd significant digit
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)
