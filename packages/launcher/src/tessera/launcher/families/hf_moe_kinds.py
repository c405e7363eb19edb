"""The router, block and expert kinds of ``transformers``' sparse MoE families: each a
``forward`` read once from one class and recognised in any family by its `source_key`, with
what it computes in ``tessera.moe``'s terms or why it cannot be reproduced (``hf_moe_routing``
says how they are used).

Routers: softmax top-k (Mixtral, Qwen, OLMoE, Granite's softmax over the top-k logits, ...),
DeepSeek-V3's sigmoid scores with a score-correction bias, groups and a routed scale (and the
families generated from it: GLM-4-MoE, dots1, EXAONE-MoE, Kimi, MiniCPM5, Solar-Open, ...),
DeepSeek-V2's softmax with group-limited greedy choice, the sigmoid-with-bias routers of
MiniMax-M2, HunYuan-V3, AFMoE and Laguna, ERNIE's softmax with a bias, Llama 4's sigmoid of
the top-k logits, GPT-OSS's softmax of the top-k logits with a bias on the logits. Blocks:
the routed experts alone, or beside a shared SwiGLU expert (gated as Qwen2-MoE's, or not),
with the choice bias on the router or on the block; Llama 4's, whose
experts (``EXPERTS_COLUMNS``: gate and up side by side in columns) take inputs scaled by the
router's weights and which returns its router's logits beside its output; GPT-OSS's, whose
experts (``EXPERTS_GPT_OSS``) have biases and a clamped SwiGLU. A key was taken
from the pinned ``transformers``; ``tests/test_hf_moe_families.py`` checks that each still
hashes to it.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import textwrap
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tessera.moe import RouterSpec, Weigh

__all__ = [
    "BANKS",
    "BLOCK_KINDS",
    "EXPERTS",
    "EXPERTS_COLUMNS",
    "EXPERTS_GPT_OSS",
    "ROUTER_KINDS",
    "SHARED_MLP",
    "SHARED_MLP_LLAMA4",
    "BankLayout",
    "BlockKind",
    "RouterKind",
    "RouterReading",
    "source_key",
]


def source_key(fn: Callable[..., Any]) -> str:
    """A hash of ``fn``'s source tokens: comments and line breaks inside brackets ignored,
    statements and indentation kept (16 hex digits); "" when its source cannot be read."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return ""
    marks = {tokenize.NEWLINE: ";", tokenize.INDENT: "{", tokenize.DEDENT: "}"}
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER)
    tokens = tokenize.generate_tokens(io.StringIO(src).readline)
    kept = [marks.get(t.type, t.string) for t in tokens if t.type not in skip]
    return hashlib.sha256(" ".join(kept).encode()).hexdigest()[:16]


BankLayout = Literal["rows", "columns", "interleaved"]
"""How a block's experts hold their gate and up projections: ``rows``: ``gate_up_proj [E, 2h,
d]`` gate rows then up, ``down_proj [E, d, h]`` (`EXPERTS`); ``columns``: ``gate_up_proj [E, d,
2h]`` gate columns then up, ``down_proj [E, h, d]`` (`EXPERTS_COLUMNS`, Llama 4);
``interleaved``: ``gate_up_proj [E, d, 2h]`` gate and up columns alternating, ``down_proj [E, h,
d]``, with biases ``gate_up_proj_bias [E, 2h]`` (alternating too) and ``down_proj_bias [E, d]``,
and the clamped SwiGLU of the bank's ``alpha`` and ``limit`` (`EXPERTS_GPT_OSS`)."""


@dataclass(frozen=True, slots=True)
class RouterReading:
    """A router in ``tessera.moe``'s terms; tensor names relative to the block: its weight, its
    choice bias ``bias`` and the bias added to its logits ``logit_bias``."""

    top_k: int
    renormalize: bool
    routing: RouterSpec
    weight: str
    bias: str | None = None
    logit_bias: str | None = None


@dataclass(frozen=True, slots=True)
class RouterKind:
    """A router ``forward``, read from ``transformers.models.<like>`` (``"<model>.<Class>"``) and
    recognised by its `source_key` ``key``: ``read(block, name)`` gives the router
    ``block.<name>`` in ``tessera.moe``'s terms (ValueError naming what of this instance cannot
    be reproduced); without ``read``, ``refusal`` says why the kind cannot be."""

    name: str
    like: str
    key: str
    read: Callable[[Any, str], RouterReading] | None = None
    refusal: str = ""


@dataclass(frozen=True, slots=True)
class BlockKind:
    """A block ``forward``, read from ``transformers.models.<like>`` and recognised by ``key``:
    its router ``router``, its shared expert ``shared`` (when the block has it) scaled per token
    by ``sigmoid(shared_gate x)`` when named, its routed output scaled by ``block.<scale>`` when
    named; ``check(block)`` says what of this instance cannot be reproduced ("" when all can);
    ``refusal``: why no instance can. ``weigh``: where the router's weights apply (``"input"``:
    each routed row scaled before its expert, Llama 4); ``bank``: how its experts are laid out
    (`BankLayout`); ``returns_logits``: the block returns ``(out, router_logits)`` (or Llama
    4's and GPT-OSS's scores), which its decoder layer unpacks."""

    name: str
    like: str
    key: str
    router: str = "gate"
    shared: str | None = None
    shared_gate: str | None = None
    scale: str | None = None
    check: Callable[[Any], str] | None = None
    refusal: str = ""
    weigh: Weigh = "output"
    bank: BankLayout = "rows"
    returns_logits: bool = False


# ---------------------------------------------------------------------------- routers
def _softmax(renormalize: bool | None, weight: str = "weight") -> Callable[[Any, str], RouterReading]:
    """Softmax over the experts, top-k; renormalised as ``renormalize`` says (None: as the
    router's ``norm_topk_prob``)."""

    def read(block: Any, name: str) -> RouterReading:
        router = getattr(block, name)
        norm = bool(router.norm_topk_prob) if renormalize is None else renormalize
        return RouterReading(int(router.top_k), norm, RouterSpec(), f"{name}.{weight}")

    return read


def _deepseek_v3(block: Any, name: str) -> RouterReading:
    router = getattr(block, name)
    spec = RouterSpec(
        score="sigmoid",
        choice_bias=True,
        groups=int(router.num_group or 1),
        top_groups=int(router.topk_group or 1),
        group_score="top2",
        scale=float(router.routed_scaling_factor),
    )
    return RouterReading(
        int(router.top_k),
        bool(router.norm_topk_prob),
        spec,
        f"{name}.weight",
        f"{name}.e_score_correction_bias",
    )


def _deepseek_v2(block: Any, name: str) -> RouterReading:
    router = getattr(block, name)
    scale = float(router.routed_scaling_factor)
    if router.topk_method == "greedy":
        spec = RouterSpec(scale=scale)
    elif router.topk_method == "group_limited_greedy":
        groups, top = int(router.num_group), int(router.topk_group)
        spec = RouterSpec(groups=groups, top_groups=top, group_score="max", scale=scale)
    else:
        raise ValueError(f"topk_method={router.topk_method!r} is not 'greedy' or 'group_limited_greedy'")
    return RouterReading(int(router.top_k), False, spec, f"{name}.weight")


def _sigmoid(
    *, bias: str, renormalize: bool | None = True, scale: str | None = None, weight: str = "weight"
) -> Callable[[Any, str], RouterReading]:
    """Sigmoid scores, chosen by score + the bias ``bias`` (relative to the block; ``{r}``: the
    router's name), renormalised (None: as ``norm_topk_prob``), scaled by router attribute ``scale``."""

    def read(block: Any, name: str) -> RouterReading:
        router = getattr(block, name)
        norm = bool(router.norm_topk_prob) if renormalize is None else renormalize
        factor = 1.0 if scale is None else float(getattr(router, scale))
        spec = RouterSpec(score="sigmoid", choice_bias=True, scale=factor)
        return RouterReading(int(router.top_k), norm, spec, f"{name}.{weight}", bias.format(r=name))

    return read


def _ernie(block: Any, name: str) -> RouterReading:
    router = getattr(block, name)
    spec = RouterSpec(choice_bias=True)
    return RouterReading(
        int(router.top_k), True, spec, f"{name}.weight", f"{name}.moe_statics.e_score_correction_bias"
    )


def _laguna(block: Any, name: str) -> RouterReading:
    router = getattr(block, name)
    if float(router.router_logit_softcapping) > 0:
        raise ValueError(
            f"router_logit_softcapping={router.router_logit_softcapping} (tanh) is not reproduced"
        )
    return _sigmoid(bias="{r}.e_score_correction_bias")(block, name)


def _cohere2(block: Any, name: str) -> RouterReading:
    router = getattr(block, name)
    if router.expert_selection_fn == "softmax":  # softmax of the top-k logits
        return RouterReading(int(router.top_k), True, RouterSpec(), f"{name}.weight")
    if router.expert_selection_fn == "sigmoid":  # sigmoid is monotone: top-k logits = top-k scores
        spec = RouterSpec(score="sigmoid")
        return RouterReading(int(router.top_k), bool(router.norm_topk_prob), spec, f"{name}.weight")
    raise ValueError(f"expert_selection_fn={router.expert_selection_fn!r} is not 'softmax' or 'sigmoid'")


def _llama4(block: Any, name: str) -> RouterReading:
    """Sigmoid of the top-k logits (sigmoid is monotone: the top-k scores), not renormalised."""
    router = getattr(block, name)
    return RouterReading(int(router.top_k), False, RouterSpec(score="sigmoid"), f"{name}.weight")


def _gpt_oss(block: Any, name: str) -> RouterReading:
    """Softmax of the top-k logits (a renormalised softmax top-k), the logits with a bias."""
    router = getattr(block, name)
    return RouterReading(int(router.top_k), True, RouterSpec(), f"{name}.weight", logit_bias=f"{name}.bias")


ROUTER_KINDS: tuple[RouterKind, ...] = (
    RouterKind("softmax-top-k", "qwen3_moe.Qwen3MoeTopKRouter", "2a5d7542c840d638", _softmax(None)),
    RouterKind("softmax-top-k", "lara_mini.LaraMiniTopKRouter", "4d19b824fc4d1a01", _softmax(None)),
    RouterKind("softmax-top-k renormalised", "mixtral.MixtralTopKRouter", "6acabffb13f6bb47", _softmax(True)),
    RouterKind(
        "softmax-top-k renormalised", "qwen3_5_moe.Qwen3_5MoeTopKRouter", "d90afdd1bd17ac09", _softmax(True)
    ),
    RouterKind(
        "softmax-top-k renormalised",
        "hunyuan_v1_moe.HunYuanMoEV1Gate",
        "bf988804b421a255",
        _softmax(True, "wg.weight"),
    ),
    RouterKind(
        "softmax of the top-k logits", "granitemoe.GraniteMoeTopKRouter", "59e872278b2330c5", _softmax(True)
    ),
    RouterKind(
        "softmax-top-k, not renormalised", "jamba.JambaTopKRouter", "2940273731f75cd4", _softmax(False)
    ),
    RouterKind(
        "top-k logits, softmax or sigmoid", "cohere2_moe.Cohere2MoeTopKRouter", "e1cfc56abee930e0", _cohere2
    ),
    RouterKind("deepseek-v3", "deepseek_v3.DeepseekV3TopkRouter", "423d9ba5bcbc29ee", _deepseek_v3),
    RouterKind("deepseek-v3", "minicpm5_moe.MiniCPM5MoeTopkRouter", "6c67854225de40a4", _deepseek_v3),
    RouterKind("deepseek-v2", "deepseek_v2.DeepseekV2TopkRouter", "28548307e0e8b78a", _deepseek_v2),
    RouterKind(
        "sigmoid + bias",
        "minimax_m2.MiniMaxM2TopKRouter",
        "06c065ffeb12e902",
        _sigmoid(bias="e_score_correction_bias"),
    ),
    RouterKind(
        "sigmoid + bias, scaled",
        "hy_v3.HYV3TopKRouter",
        "eee38278778cab25",
        _sigmoid(bias="e_score_correction_bias", scale="router_scaling_factor"),
    ),
    RouterKind(
        "sigmoid + bias, scaled",
        "afmoe.AfmoeTokenChoiceRouter",
        "b679ac2f3ef704d3",
        _sigmoid(bias="expert_bias", scale="route_scale", weight="gate.weight"),
    ),
    RouterKind("sigmoid + bias", "laguna.LagunaTopKRouter", "a5c7b29ef9b9cf47", _laguna),
    RouterKind("softmax + bias", "ernie4_5_moe.Ernie4_5_MoeTopKRouter", "4097eaeeeec9d3ab", _ernie),
    RouterKind("sigmoid of the top-k logits", "llama4.Llama4Router", "6059462df44bcda0", _llama4),
    RouterKind(
        "softmax of the top-k biased logits", "gpt_oss.GptOssTopKRouter", "f4d868f0a4f2a58a", _gpt_oss
    ),
    RouterKind(
        "sparsemixer",
        "phimoe.PhimoeTopKRouter",
        "d728119ac0107b87",
        refusal="PhiMoE's sparsemixer routing is not reproduced: in training it draws each of its 2 experts "
        "by Gumbel sampling among those within a jitter threshold of the best, and weighs it by a softmax "
        "over that masked set with a Heun third-order gradient estimator; tessera.moe's routers choose the "
        "top-k deterministically and differentiate their weights exactly",
    ),
    RouterKind(
        "bias on the logits",
        "kolibri1.Kolibri1TopKRouter",
        "a031a3a1ec09f295",
        refusal="Kolibri's router chooses by logits + bias and weighs by sigmoid(logit); tessera.moe adds "
        "the choice bias to the scores",
    ),
    RouterKind(
        "group mask 0.0",
        "axk2.AXK2TopkRouter",
        "7189c64fb391e00a",
        refusal="AXK2's router sets the experts outside the chosen groups to 0.0, not -inf: with a negative "
        "score-correction bias such an expert can still be chosen",
    ),
)


# ---------------------------------------------------------------------------- blocks
def _no_jitter(block: Any) -> str:
    noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
    return f"router_jitter_noise={noise} is not reproduced; use 0" if noise > 0 else ""


def _cohere2_shared(block: Any) -> str:
    count, how = int(block.num_shared_experts), block.shared_expert_combination_strategy
    return f"shared_expert_combination_strategy={how!r} halves the sum" if count and how != "sum" else ""


BLOCK_KINDS: tuple[BlockKind, ...] = (
    BlockKind("routed", "mixtral.MixtralSparseMoeBlock", "ac238948f35bf268", check=_no_jitter),
    BlockKind("routed", "qwen3_moe.Qwen3MoeSparseMoeBlock", "534236ee557074ab"),
    BlockKind("routed", "olmoe.OlmoeSparseMoeBlock", "144f1f6062d60a83"),
    BlockKind("routed", "mimo_v2_flash.MiMoV2FlashMoE", "d9169f2e3664d6ed"),
    BlockKind("routed", "granitemoe.GraniteMoeMoE", "0587cde4a0256465", router="router"),
    BlockKind("routed", "jamba.JambaSparseMoeBlock", "616317a56aa2b6b2", router="router"),
    BlockKind("routed", "minimax_m2.MiniMaxM2SparseMoeBlock", "74baa309830af5fe", check=_no_jitter),
    BlockKind(
        "gated shared expert",
        "qwen2_moe.Qwen2MoeSparseMoeBlock",
        "3b61df14485d445b",
        shared="shared_expert",
        shared_gate="shared_expert_gate",
    ),
    BlockKind("shared experts", "deepseek_v3.DeepseekV3MoE", "6ad5ccdee9e1ee32", shared="shared_experts"),
    BlockKind(
        "shared expert", "lara_mini.LaraMiniSparseMoeBlock", "e5949cd79cbaedc7", shared="shared_expert"
    ),
    BlockKind("shared expert", "hunyuan_v1_moe.HunYuanMoEV1Moe", "5789cecb016b634c", shared="shared_mlp"),
    BlockKind(
        "shared experts",
        "ernie4_5_moe.Ernie4_5_MoeSparseMoeBlock",
        "bb534e1bb40a3dc7",
        shared="shared_experts",
    ),
    BlockKind("shared experts", "hy_v3.HYV3MoE", "0c03a33ca3b43f9a", shared="shared_experts"),
    BlockKind(
        "shared experts",
        "afmoe.AfmoeSparseMoeBlock",
        "843096a808247c52",
        router="router",
        shared="shared_experts",
    ),
    BlockKind(
        "shared experts",
        "cohere2_moe.Cohere2MoeSparseMoeBlock",
        "038747a5249ec312",
        shared="shared_experts",
        check=_cohere2_shared,
    ),
    BlockKind(
        "shared experts, scaled",
        "laguna.LagunaSparseMoeBlock",
        "64d903442afae8ba",
        shared="shared_experts",
        scale="routed_scaling_factor",
    ),
    BlockKind("routed", "phimoe.PhimoeSparseMoeBlock", "ed9f2a1a1f64bc16", router="router"),
    BlockKind(
        "post-norm",
        "axk1.AXK1MoE",
        "b502c139b705dbdd",
        refusal="AXK1 normalises the mixture's output inside its block (post_mlp_layernorm)",
    ),
    BlockKind(
        "transposed",
        "aria.AriaTextMoELayer",
        "cd445890d17a1847",
        refusal="Aria stores its experts transposed ([E, d, 2h], applied with @)",
    ),
    BlockKind(
        "input-weighted, shared expert",
        "llama4.Llama4TextMoe",
        "9a4399d06cacc5a1",
        router="router",
        shared="shared_expert",
        weigh="input",
        bank="columns",
        returns_logits=True,
    ),
    BlockKind(
        "biased, clamped SwiGLU",
        "gpt_oss.GptOssMLP",
        "63c4987163e66fbf",
        router="router",
        bank="interleaved",
        returns_logits=True,
    ),
    BlockKind(
        "hash",
        "deepseek_v4.DeepseekV4SparseMoeBlock",
        "2cdca842054e5399",
        refusal="DeepSeek-V4 routes by token id (hash routing) and clamps its SwiGLU",
    ),
    BlockKind(
        "zero experts",
        "longcat_flash.LongcatFlashMoE",
        "ab398d8b6acc22fd",
        refusal="LongCat-Flash routes to identity ('zero') experts beyond the real ones",
    ),
    BlockKind(
        "shared gammas",
        "inkling.InklingMoE",
        "630e596f640eedef",
        refusal="Inkling's router weighs its shared experts too (shared gammas)",
    ),
    BlockKind(
        "router state",
        "zaya.ZayaSparseMoeBlock",
        "fd7051b4af6a7de1",
        refusal="ZAYA's router reads a state carried from the previous layer's router",
    ),
)
# the experts every kind reads: gate_up [E, 2h, d], down [E, d, h], down(act(gate x) * up x) per expert
EXPERTS = ("mixtral.MixtralExperts", "6d01f0e7fd489d85")
# Llama 4's experts: gate_up [E, d, 2h] (gate columns, then up), down [E, h, d], every expert run
# on every token (bmm), its input scaled by the router's weight: 0 for the unchosen, whose output
# is then 0 (no biases)
EXPERTS_COLUMNS = ("llama4.Llama4TextExperts", "bd2ee5a83482a75a")
# GPT-OSS's experts: gate and up columns interleaved, biases, the clamped SwiGLU; each expert run
# on its tokens, its output weighted by the router
EXPERTS_GPT_OSS = ("gpt_oss.GptOssExperts", "dfcd1b73ad425a57")
BANKS: dict[BankLayout, tuple[str, str]] = {
    "rows": EXPERTS,
    "columns": EXPERTS_COLUMNS,
    "interleaved": EXPERTS_GPT_OSS,
}
# the shared expert: gate_proj, up_proj, down_proj (Linear), down(act(gate x) * up x)
SHARED_MLP = ("deepseek_v3.DeepseekV3MLP", "b4823f5258a37fcc")
# the same, its activation named ``activation_fn``
SHARED_MLP_LLAMA4 = ("llama4.Llama4TextMLP", "37a3bb18a859d47a")
