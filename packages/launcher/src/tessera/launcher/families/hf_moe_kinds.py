"""The block and expert kinds of ``transformers``' sparse MoE families, and the types of every
kind: each a ``forward`` read once from one class and recognised in any family by its
`source_key`, with what it computes in ``tessera.moe``'s terms or why it cannot be reproduced
(``hf_moe_routing`` says how they are used; the router kinds are ``hf_moe_router_kinds``').

Blocks: the routed experts alone, or beside a shared SwiGLU expert (gated as Qwen2-MoE's, or
not), with the choice bias on the router or on the block; Llama 4's, whose experts
(``EXPERTS_COLUMNS``: gate and up side by side in columns) take inputs scaled by the router's
weights and which returns its router's logits beside its output; GPT-OSS's, whose experts
(``EXPERTS_GPT_OSS``) have biases and a clamped SwiGLU; Aria's (its experts by columns),
Nemotron-H's (non-gated experts and shared expert), DBRX's (its experts' flat ``mlp.w1`` /
``v1`` / ``w2``), LongCat-Flash's zero experts, AXK1's post-norm, DeepSeek-V4's (hash routing by
token id in its first layers). The expert banks and shared experts each kind of block holds are
``hf_moe_banks``'. A key was taken from the pinned ``transformers``;
``tests/test_hf_moe_families.py`` checks that each still hashes to it.
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


BankLayout = Literal[
    "rows", "columns", "interleaved", "up_rows", "flat_rows", "parallel_experts", "up_columns"
]
"""How a block's experts hold their gate and up projections: ``rows``: ``gate_up_proj [E, 2h,
d]`` gate rows then up, ``down_proj [E, d, h]`` (`EXPERTS`); ``columns``: ``gate_up_proj [E, d,
2h]`` gate columns then up, ``down_proj [E, h, d]`` (`EXPERTS_COLUMNS`, Llama 4);
``interleaved``: ``gate_up_proj [E, d, 2h]`` gate and up columns alternating, ``down_proj [E, h,
d]``, with biases ``gate_up_proj_bias [E, 2h]`` (alternating too) and ``down_proj_bias [E, d]``,
and the clamped SwiGLU of the bank's ``alpha`` and ``limit`` (`EXPERTS_GPT_OSS`); ``up_rows``: not
gated, ``up_proj [E, h, d]``, ``down_proj [E, d, h]`` (Nemotron-H); ``flat_rows``: ``mlp.w1``,
``mlp.v1`` (gate, up) and ``mlp.w2`` (down, applied as it is), each ``[E*h, d]`` (DBRX);
``parallel_experts``: on the block itself, ``input_linear.weight [E, 2h, d]`` (gate rows, then up)
and ``output_linear.weight [E, d, h]`` (JetMoE's ``JetMoeParallelExperts``); ``up_columns``: not
gated, ``up_proj [E, d, h]``, ``down_proj [E, h, d]``, as ``tessera.moe`` holds them (Ergo). Which experts
modules each layout reads, and their activations: ``hf_moe_banks``."""


@dataclass(frozen=True, slots=True)
class RouterReading:
    """A router in ``tessera.moe``'s terms; tensor names relative to the block: its weight, its
    choice bias ``bias`` and the bias added to its logits ``logit_bias``; ``shared``: how many
    logits after the routed ones score the block's shared experts (Inkling's: ``tessera.moe.MoE``'s
    ``shared_scores``), ``scale``: its trained scalar multiplying every weight (Inkling's
    ``global_scale``: ``router_scale``); ``table``: its table of each token id's experts (DeepSeek-V4's
    ``tid2eid [vocab, k]``: ``tessera.moe.MoE``'s ``hash_vocab``, the router's ``tid2eid``)."""

    top_k: int
    renormalize: bool
    routing: RouterSpec
    weight: str
    bias: str | None = None
    logit_bias: str | None = None
    shared: int = 0
    scale: str | None = None
    table: str | None = None


@dataclass(frozen=True, slots=True)
class RouterKind:
    """A router ``forward``, read from ``transformers.models.<like>`` (``"<model>.<Class>"``) and
    recognised by its `source_key` ``key``: ``read(block, name)`` gives the router
    ``block.<name>`` in ``tessera.moe``'s terms (ValueError naming what of this instance cannot
    be reproduced); without ``read``, ``refusal`` says why the kind cannot be. ``float32``: the
    router computes its logits in fp32 whatever the model's dtype (``F.linear(x.float(),
    weight.float())``: ``tessera.moe.RouterSpec``'s ``float32``)."""

    name: str
    like: str
    key: str
    read: Callable[[Any, str], RouterReading] | None = None
    refusal: str = ""
    float32: bool = False


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
    output (AXK1's ``post_mlp_layernorm``); ``out_bias``: the bias ``[d]`` the block adds to its
    output (JetMoE's ``bias``: `tessera.moe.output_bias.OutputBiasMoE`); ``shared_scores``: its shared
    experts are weighed by the router's scores of them (Inkling's shared gammas)."""

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
    out_bias: str | None = None
    shared_scores: bool = False


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


def _deepseek_v4_hash(block: Any) -> str:
    hashed, table = bool(block.is_hash), hasattr(block.gate, "tid2eid")
    if hashed != table:
        held = "lacks" if hashed else "holds"
        return f"is_hash={hashed} but its router {type(block.gate).__name__} {held} tid2eid"
    return ""


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
    # DeepSeek-V4's: its first 'hash_moe' layers (mlp_layer_types) read each token's experts from
    # a fixed table at its id (the router kind reads it: tessera.moe's hash routing), which its
    # decoder layers pass to every block as input_ids; a shared expert with the experts' clamps
    BlockKind(
        "hash or top-k, shared expert",
        "deepseek_v4.DeepseekV4SparseMoeBlock",
        "2cdca842054e5399",
        shared="shared_experts",
        check=_deepseek_v4_hash,
    ),
    BlockKind(
        "zero experts",
        "longcat_flash.LongcatFlashMoE",
        "ab398d8b6acc22fd",
        router="router",
        identity="zero_expert_num",
    ),
    BlockKind("routed, bias on the block", "lfm2_moe.Lfm2MoeSparseMoeBlock", "4362f1019711ae79"),
    # Inkling's router weighs its shared experts too (shared gammas; its router kind reads them)
    BlockKind(
        "shared gammas",
        "inkling.InklingMoE",
        "630e596f640eedef",
        shared="shared_experts",
        shared_scores=True,
    ),
    BlockKind(
        "router state",
        "zaya.ZayaSparseMoeBlock",
        "fd7051b4af6a7de1",
        refusal="ZAYA's router is an MLP (down_proj, an RMS norm, two GELU layers) that adds a state carried "
        "from the previous layer's router (router_states_scale) and may choose a skip expert that "
        "contributes nothing, which no RouterSpec says; its block converts with the router kept as written "
        "(hf_moe_kept)",
    ),
    # JetMoE's MLP mixture (not its mixture of attention heads, JetMoeMoA, which its attention
    # calls through map / reduce and which is no block): experts on the block, an output bias
    BlockKind(
        "routed, output bias",
        "jetmoe.JetMoeMoE",
        "6f3612ddbc63a69e",
        router="router",
        bank="parallel_experts",
        out_bias="bias",
    ),
    # Beam's: DeepSeek-V3's router, the routed scale applied by the block after the sum
    BlockKind("routed, scaled", "beam.BeamMoE", "37bd3d6b336f05fa", scale="routed_scaling_factor"),
    # Gemma 4's (enable_moe_block): the decoder layer itself holds the router and the experts;
    # converted as a whole layer by hf_gemma4 (which holds this key too), never read as a block
    BlockKind(
        "mixture inside the decoder layer",
        "gemma4.Gemma4TextDecoderLayer",
        "eb7d5248b61c335c",
        router="router",
        refusal="Gemma 4's mixture sits inside its decoder layer (enable_moe_block) beside the dense MLP, "
        "with no block of its own to replace: tessera.launcher.families.hf_gemma4 converts the layer's "
        "mixture (layer_mixture, attach) where the layer's forward is the one it was written for",
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
