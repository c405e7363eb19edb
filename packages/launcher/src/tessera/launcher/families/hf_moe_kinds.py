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
experts (``EXPERTS_GPT_OSS``) have biases and a clamped SwiGLU; Aria's (its experts by columns,
weighing their outputs, Aria's router a softmax of the top-k logits), Nemotron-H's (non-gated
experts and shared expert), DBRX's (its softmax top-k and its p-norm in the block, its experts'
flat ``mlp.w1`` / ``v1`` / ``w2``), beside the sigmoid-with-bias routers of Inkling 2 and
MiniMax-M3. The expert banks and shared experts each kind of block holds are ``hf_moe_banks``'.
A key was taken from the pinned ``transformers``; ``tests/test_hf_moe_families.py`` checks that
each still hashes to it.
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
    "BLOCK_KINDS",
    "EXPERTS",
    "EXPERTS_COLUMNS",
    "EXPERTS_GPT_OSS",
    "RMS_NORM",
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


BankLayout = Literal["rows", "columns", "interleaved", "up_rows", "flat_rows"]
"""How a block's experts hold their gate and up projections: ``rows``: ``gate_up_proj [E, 2h,
d]`` gate rows then up, ``down_proj [E, d, h]`` (`EXPERTS`); ``columns``: ``gate_up_proj [E, d,
2h]`` gate columns then up, ``down_proj [E, h, d]`` (`EXPERTS_COLUMNS`, Llama 4);
``interleaved``: ``gate_up_proj [E, d, 2h]`` gate and up columns alternating, ``down_proj [E, h,
d]``, with biases ``gate_up_proj_bias [E, 2h]`` (alternating too) and ``down_proj_bias [E, d]``,
and the clamped SwiGLU of the bank's ``alpha`` and ``limit`` (`EXPERTS_GPT_OSS`); ``up_rows``: not
gated, ``up_proj [E, h, d]``, ``down_proj [E, d, h]`` (Nemotron-H); ``flat_rows``: ``mlp.w1``,
``mlp.v1`` (gate, up) and ``mlp.w2`` (down, applied as it is), each ``[E*h, d]`` (DBRX). Which
experts modules each layout reads, and their activations: ``hf_moe_banks``."""


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
    4's and GPT-OSS's scores), which its decoder layer unpacks; ``identity``: the block's
    attribute counting its identity experts (LongCat-Flash's zero experts: ``tessera.moe.MoE``'s
    ``identity_experts``); ``post_norm``: the RMS norm (`RMS_NORM`) the block applies to its
    output (AXK1's ``post_mlp_layernorm``)."""

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
    identity: str | None = None
    post_norm: str | None = None


# ---------------------------------------------------------------------------- routers
def _softmax(renormalize: bool | None, weight: str = "weight") -> Callable[[Any, str], RouterReading]:
    """Softmax over the experts, top-k; renormalised as ``renormalize`` says (None: as the
    router's ``norm_topk_prob``)."""

    def read(block: Any, name: str) -> RouterReading:
        router = getattr(block, name)
        norm = bool(router.norm_topk_prob) if renormalize is None else renormalize
        return RouterReading(int(router.top_k), norm, RouterSpec(), f"{name}.{weight}")

    return read


def _deepseek_v3(block: Any, name: str, fill: float = float("-inf")) -> RouterReading:
    router = getattr(block, name)
    spec = RouterSpec(
        score="sigmoid",
        choice_bias=True,
        groups=int(router.num_group or 1),
        top_groups=int(router.topk_group or 1),
        group_score="top2",
        scale=float(router.routed_scaling_factor),
        group_fill=fill,
    )
    return RouterReading(
        int(router.top_k),
        bool(router.norm_topk_prob),
        spec,
        f"{name}.weight",
        f"{name}.e_score_correction_bias",
    )


def _axk2(block: Any, name: str) -> RouterReading:
    """DeepSeek-V3's router, the experts outside the kept groups set to 0.0 for the choice."""
    return _deepseek_v3(block, name, fill=0.0)


def _kolibri(block: Any, name: str) -> RouterReading:
    """Chosen by the logits plus the bias, weighed by the chosen experts' sigmoid scores."""
    router = getattr(block, name)
    spec = RouterSpec(score="sigmoid", choice_bias=True, choose_by="logits")
    bias = f"{name}.e_score_correction_bias"
    return RouterReading(int(router.top_k), bool(router.norm_topk_prob), spec, f"{name}.weight", bias)


def _lfm2(block: Any, name: str) -> RouterReading:
    """Sigmoid scores, chosen by score + the block's ``expert_bias`` when ``use_expert_bias``,
    renormalised by ``sum + 1e-6`` when ``norm_topk_prob``, scaled by ``routed_scaling_factor``."""
    router = getattr(block, name)
    biased = bool(router.use_expert_bias)
    if biased != bool(block.use_expert_bias):
        raise ValueError(
            f"the router's use_expert_bias ({router.use_expert_bias}) is not the block's "
            f"({block.use_expert_bias})"
        )
    scale = float(router.routed_scaling_factor)
    spec = RouterSpec(score="sigmoid", choice_bias=biased, scale=scale, renorm_eps=1e-6)
    bias = "expert_bias" if biased else None
    return RouterReading(int(router.top_k), bool(router.norm_topk_prob), spec, f"{name}.weight", bias)


def _longcat(block: Any, name: str) -> RouterReading:
    """Softmax over the real and the zero experts, chosen by score + bias, not renormalised,
    scaled; a bias of the classifier, which its forward does not add, refused."""
    router = getattr(block, name)
    if router.classifier.bias is not None:
        raise ValueError("its router's classifier has a bias, which LongCat-Flash's forward leaves out")
    spec = RouterSpec(choice_bias=True, scale=float(router.routed_scaling_factor))
    weight, bias = f"{name}.classifier.weight", f"{name}.e_score_correction_bias"
    return RouterReading(int(router.top_k), False, spec, weight, bias)


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


def _flint(block: Any, name: str) -> RouterReading:
    """Sigmoid scores without a bias (fp32 logits), renormalised as ``norm_topk_prob`` says."""
    router = getattr(block, name)
    return RouterReading(
        int(router.top_k), bool(router.norm_topk_prob), RouterSpec(score="sigmoid"), f"{name}.weight"
    )


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


def _dbrx(block: Any, name: str) -> RouterReading:
    """DBRX's router holds the logits' ``nn.Linear``; its block takes a softmax top-k, divided by
    its ``moe_normalize_expert_weights``-norm (1: renormalised; None: not)."""
    router = getattr(block, name)
    jitter = router.moe_jitter_eps
    if jitter:
        raise ValueError(
            f"moe_jitter_eps={jitter} (noise on the router's input in training) is not reproduced"
        )
    p = block.moe_normalize_expert_weights
    if p is not None and float(p) != 1.0:
        raise ValueError(
            f"moe_normalize_expert_weights={p}: only the 1-norm (renormalised) or None is reproduced"
        )
    return RouterReading(int(block.top_k), p is not None, RouterSpec(), f"{name}.layer.weight")


def _inkling2(block: Any, name: str) -> RouterReading:
    """Inkling 2's router: ``scoring_func`` scores (sigmoid reproduced), chosen by score + bias,
    renormalised (``sum + 1e-20``), scaled by ``routed_scaling_factor``."""
    router = getattr(block, name)
    if type(router.score_fn).__name__ != "Sigmoid":
        raise ValueError(f"its scoring function {type(router.score_fn).__name__} is not the sigmoid")
    return _sigmoid(bias="{r}.e_score_correction_bias", scale="routed_scaling_factor")(block, name)


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
    RouterKind("sigmoid top-k", "flint.FlintTopKRouter", "c263946af55a5133", _flint),
    RouterKind("softmax + bias", "ernie4_5_moe.Ernie4_5_MoeTopKRouter", "4097eaeeeec9d3ab", _ernie),
    RouterKind("sigmoid of the top-k logits", "llama4.Llama4Router", "6059462df44bcda0", _llama4),
    RouterKind("softmax of the top-k logits", "aria.AriaTextTopKRouter", "db4ba175e9d6f201", _softmax(True)),
    RouterKind("softmax top-k, p-norm in the block", "dbrx.DbrxRouter", "54b5752f119b7342", _dbrx),
    RouterKind("sigmoid + bias, scaled", "inkling2.Inkling2TopKRouter", "31734db132527195", _inkling2),
    RouterKind(
        "sigmoid + bias",
        "minimax_m3_vl.MiniMaxM3VLTopKRouter",
        "6073d636981d43a1",
        _sigmoid(bias="{r}.e_score_correction_bias"),
    ),
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
    RouterKind("sigmoid, by logits + bias", "kolibri1.Kolibri1TopKRouter", "a031a3a1ec09f295", _kolibri),
    RouterKind("deepseek-v3, groups masked to 0.0", "axk2.AXK2TopkRouter", "7189c64fb391e00a", _axk2),
    RouterKind("sigmoid + block's bias, scaled", "lfm2_moe.Lfm2MoeTopKRouter", "986975a29bb20107", _lfm2),
    RouterKind(
        "softmax + bias, zero experts too",
        "longcat_flash.LongcatFlashTopkRouter",
        "e719a3b78df5fbe9",
        _longcat,
    ),
)


# ---------------------------------------------------------------------------- blocks
def _no_jitter(block: Any) -> str:
    noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
    return f"router_jitter_noise={noise} is not reproduced; use 0" if noise > 0 else ""


def _no_latent(block: Any) -> str:
    names = ("fc1_latent_proj", "fc2_latent_proj")
    latent = [n for n in names if type(getattr(block, n)).__name__ != "Identity"]
    if not latent:
        return ""
    return f"{', '.join(latent)}: the experts' latent projections (moe_latent_size) are not reproduced"


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
        "shared experts, post-norm",
        "axk1.AXK1MoE",
        "b502c139b705dbdd",
        shared="shared_experts",
        post_norm="post_mlp_layernorm",
    ),
    BlockKind(
        "shared experts",
        "aria.AriaTextMoELayer",
        "cd445890d17a1847",
        router="router",
        shared="shared_experts",
        bank="columns",
    ),
    BlockKind(
        "shared experts, not gated",
        "nemotron_h.NemotronHMoE",
        "cfbc66b1a57d1318",
        shared="shared_experts",
        bank="up_rows",
        check=_no_latent,
    ),
    BlockKind("routed, flat banks", "dbrx.DbrxFFN", "442fbc6c10018858", router="router", bank="flat_rows"),
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
        refusal="DeepSeek-V4's block takes the token ids: its first 'hash_moe' layers (mlp_layer_types) "
        "choose experts by a fixed table (tid2eid[input_ids]), which tessera.moe.MoE, called with the hidden "
        "states alone, cannot see; its experts clamp gate (max) and up (both sides) before silu(gate) * up "
        "(swiglu_limit), and its decoder layers mix hc_mult residual streams",
    ),
    BlockKind(
        "zero experts",
        "longcat_flash.LongcatFlashMoE",
        "ab398d8b6acc22fd",
        router="router",
        identity="zero_expert_num",
    ),
    BlockKind("routed, bias on the block", "lfm2_moe.Lfm2MoeSparseMoeBlock", "4362f1019711ae79"),
    BlockKind(
        "shared gammas",
        "inkling.InklingMoE",
        "630e596f640eedef",
        refusal="Inkling's router weighs its shared experts too: it holds a logit per shared expert beside "
        "the routed ones, normalises sigmoid(logit) over the chosen and the shared experts together, "
        "scales by a trained global_scale, and weighs each shared expert by its own share (shared gammas); "
        "tessera.moe's shared expert is one ungated or sigmoid-gated MLP",
    ),
    BlockKind(
        "router state",
        "zaya.ZayaSparseMoeBlock",
        "fd7051b4af6a7de1",
        refusal="ZAYA's router is an MLP (down_proj, an RMS norm, two GELU layers) that adds a state carried "
        "from the previous layer's router (router_states_scale) and may choose a skip expert that "
        "contributes nothing; tessera.moe's router is one linear map of this layer's input",
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
# a block's post-norm: weight * x / sqrt(mean(x^2) + variance_epsilon), in fp32, cast back
RMS_NORM = ("axk1.AXK1RMSNorm", "fc88e83cea061d00")
# the shared expert: gate_proj, up_proj, down_proj (Linear), down(act(gate x) * up x)
SHARED_MLP = ("deepseek_v3.DeepseekV3MLP", "b4823f5258a37fcc")
# the same, its activation named ``activation_fn``
SHARED_MLP_LLAMA4 = ("llama4.Llama4TextMLP", "37a3bb18a859d47a")
