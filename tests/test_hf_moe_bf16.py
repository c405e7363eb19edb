"""In bf16, a converted HF mixture computes its routers as transformers does.

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

Tier 2 (the worker pool): what transformers keeps in fp32 when it loads a family in bf16
(``_keep_in_fp32_modules_strict``: DeepSeek-V3's router weight and score-correction bias; Ergo's
also its norms and embedding) ``boost()`` computes in fp32 at dp=2 x ep=2 in bf16 (ZeRO-1 and
ZeRO-3), every other tensor in bf16, and the run follows the fp32 serial run to bf16's
resolution. That the kept tensors train exactly as a serial mixed-precision run is
``packages/zero/tests/test_zero_keep_fp32.py``'s.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

import pytest
import torch

from tessera.comm.testing.fixtures import PoolFactory
from tessera.launcher import Config, ParallelConfig, TrainConfig, ZeroConfig, boost
from tessera.launcher.families.hf_moe import convert_hf_moe, moe_from_hf
from tessera.launcher.families.hf_moe_export import block_tensor
from tessera.launcher.families.hf_moe_kinds import BLOCK_KINDS, source_key
from tessera.launcher.families.hf_moe_routing import read_layout
from tessera.launcher.testing import RandomTokens, serial_run, sgd
from tessera.launcher.testing_hf_moe import sparse_blocks, tiny_moe_model
from tessera.zero import Precision

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


# ---------------------------------------------------------------------------- tier 2
VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 4, 3, 0.2
TOKENS = RandomTokens(vocab=VOCAB, batch=BATCH, seq=SEQ)
# what transformers keeps in fp32 in bf16 (_keep_in_fp32_modules_strict), as boost() trains it:
# DeepSeek-V3's router weight and score-correction bias; DeepSeek-V4's score-correction bias (its
# top-k layer's) and hyper-connection mixers; Ergo's also its norms and embedding
KEPT = {
    "deepseek_v3": ("mlp.router.weight", "mlp.router.score_bias"),
    "deepseek_v4": ("layers.1.mlp.router.score_bias", "attn_hc.fn", "hc_head.hc_fn"),
    "ergo": ("mlp.router.weight", "mlp.router.score_bias", "embed_tokens.weight", "input_layernorm.weight"),
}


def _build(family: str) -> Any:
    model: Any = tiny_moe_model(family)
    model.config.use_cache = False
    return model


def _bf16_run(rank: int, config: Config, family: str) -> tuple[dict[str, torch.dtype], list[float]]:
    model = _build(family)
    engine = boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), config)
    names = engine.placement.names
    with engine.zero.gathered():  # what the model computes with
        dtypes = {names[p]: p.dtype for p in engine.module.parameters()}
    dtypes |= {f"{n}(buffer)": b.dtype for n, b in engine.module.named_buffers() if n.endswith("score_bias")}
    losses = [engine.train_step(*TOKENS.at(step)).loss for step in range(STEPS)]
    engine.mesh.close()
    return dtypes, losses


MODES = {
    "ep2-zero1": (ParallelConfig(dp=2, ep=2, microbatches=1), 1),
    "ep2-zero3": (ParallelConfig(dp=2, ep=2, microbatches=1), 3),
    "tp2": (ParallelConfig(tp=2, microbatches=1), 1),
    "pp2": (ParallelConfig(pp=2, microbatches=2, schedule="1f1b"), 1),
}


BF16_CASES = [(f, m) for f in sorted(KEPT) for m in sorted(MODES)]


@pytest.mark.parametrize(("family", "mode"), BF16_CASES)
def test_boost_computes_in_fp32_what_transformers_keeps_in_fp32(
    worker_pools: PoolFactory, family: str, mode: str
) -> None:
    """bf16 at dp=2 x ep=2 (ZeRO-1 and ZeRO-3), tp=2 and pp=2 (1F1B), no plan written: the tensors
    transformers keeps in fp32 are fp32 where the model computes (the converted routers' weights
    and score biases by the HF tensors they export as), every other one bf16; the losses follow
    the fp32 serial run's to bf16's resolution (0.05 at losses near 4: 8 significant bits) and
    are finite (a router computing in bf16 would still pass this bound: its exactness is the
    tier-0 test's)."""
    parallel, zero = MODES[mode]
    c = Config(parallel=parallel, zero=ZeroConfig(stage=zero), train=TrainConfig(precision=Precision.BF16))
    config = dataclasses.replace(c, optim=dataclasses.replace(c.optim, clip_grad_norm=0.0))
    results = worker_pools(config.world_size).run(_bf16_run, config, family, timeout=180)
    want, _ = serial_run(_converted(family), TOKENS.first(STEPS), sgd(LR))
    for dtypes, losses in results:
        fp32 = sorted(n for n, d in dtypes.items() if d == torch.float32)
        if mode != "pp2":  # a pp rank holds its stages' tensors only
            assert all(any(k in n for n in fp32) for k in KEPT[family]), (KEPT[family], fp32)
        assert all(d == torch.bfloat16 for n, d in dtypes.items() if n not in fp32), dtypes
        assert max(abs(a - b) for a, b in zip(losses, want, strict=True)) < 0.05, (losses, want)


def _converted(family: str) -> Any:
    model = _build(family)
    convert_hf_moe(model)
    return model
