"""The router kinds of ``transformers``' sparse MoE families (`ROUTER_KINDS`): each a router
``forward`` read once from one class, recognised in any family by its `source_key`, with a
reader giving it in ``tessera.moe``'s terms (`RouterReading`) or the reason it cannot be
reproduced. Softmax top-k (Mixtral, Qwen, OLMoE, Granite's softmax over the top-k logits, ...),
DeepSeek-V3's sigmoid scores with a score-correction bias, groups and a routed scale (and the
families generated from it), DeepSeek-V2's softmax with group-limited greedy choice, the
sigmoid-with-bias routers (MiniMax-M2/M3, HunYuan-V3, AFMoE, Laguna, Inkling 2, LFM2, Kolibri),
ERNIE's softmax with a bias, Llama 4's sigmoid of the top-k logits, GPT-OSS's softmax of the
top-k logits with a bias on the logits, DBRX's p-norm, LongCat-Flash's zero experts, Ergo's
sigmoid-with-bias, Inkling's that scores its shared experts too, DeepSeek-V4's sqrt(softplus)
scores (chosen by score + bias, or read from a table by token id: hash routing); PhiMoE's
sampled sparsemixer is not read here (its block keeps its router: ``hf_moe_kept``). The types
and the block kinds are ``hf_moe_kinds``'. A kind marked ``float32`` computes its logits in fp32
in any dtype, as its HF forward does (DeepSeek-V3's ``F.linear(x.float(), weight.float())``;
``tests/test_hf_moe_bf16.py`` holds each to HF's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tessera.launcher.families.hf_moe_kinds import RouterKind, RouterReading
from tessera.moe import RouterSpec
from tessera.moe.router import ScoreFunction

__all__ = ["ROUTER_KINDS"]


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
    # its sigmoid, renormalisation and scale in the logits' dtype
    spec = RouterSpec(score="sigmoid", choice_bias=biased, scale=scale, renorm_eps=1e-6, in_logits_dtype=True)
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
    spec = RouterSpec(in_logits_dtype=True)  # softmax(logits, dtype=logits.dtype), its norm alike
    return RouterReading(int(block.top_k), p is not None, spec, f"{name}.layer.weight")


def _inkling2(block: Any, name: str) -> RouterReading:
    """Inkling 2's router: ``scoring_func`` scores (sigmoid reproduced), chosen by score + bias,
    renormalised (``sum + 1e-20``), scaled by ``routed_scaling_factor``."""
    router = getattr(block, name)
    if type(router.score_fn).__name__ != "Sigmoid":
        raise ValueError(f"its scoring function {type(router.score_fn).__name__} is not the sigmoid")
    return _sigmoid(bias="{r}.e_score_correction_bias", scale="routed_scaling_factor")(block, name)


def _ergo(block: Any, name: str) -> RouterReading:
    """Ergo's router: fp32 logits of ``linear``, sigmoid scores chosen by score + bias, always
    renormalised (``sum + 1e-20``), scaled by ``routed_scaling_factor``."""
    read = _sigmoid(bias="{r}.e_score_correction_bias", scale="routed_scaling_factor", weight="linear.weight")
    return read(block, name)


def _inkling(block: Any, name: str) -> RouterReading:
    """Inkling's router: a logit per routed expert and, after them, per shared expert; sigmoid
    scores, the routed chosen by score + bias; the chosen and the shared scores normalised
    together (``exp(logsigmoid - logsumexp(logsigmoid))``: the same as dividing by their sum),
    times ``route_scale`` and the trained ``global_scale``; the shared experts weighed by theirs."""
    router = getattr(block, name)
    shared, routed = int(router.n_shared_experts), int(router.num_experts)
    if shared < 1 or tuple(router.weight.shape[:1]) != (routed + shared,):
        raise ValueError(
            f"its router's weight {tuple(router.weight.shape)} does not hold {routed} routed and {shared} "
            "shared experts' logits"
        )
    spec = RouterSpec(score="sigmoid", choice_bias=True, scale=float(router.route_scale))
    bias, scale = f"{name}.e_score_correction_bias", f"{name}.global_scale"
    return RouterReading(int(router.top_k), True, spec, f"{name}.weight", bias, shared=shared, scale=scale)


def _gpt_oss(block: Any, name: str) -> RouterReading:
    """Softmax of the top-k logits (a renormalised softmax top-k), the logits with a bias."""
    router = getattr(block, name)
    return RouterReading(int(router.top_k), True, RouterSpec(), f"{name}.weight", logit_bias=f"{name}.bias")


def _beam(block: Any, name: str) -> RouterReading:
    """DeepSeek-V3's router (sigmoid, choice bias, top-2 group scores, ``sum + 1e-20``), fp32
    logits, without a scale of its own: Beam's block scales the sum (``BlockKind.scale``)."""
    router = getattr(block, name)
    spec = RouterSpec(
        score="sigmoid",
        choice_bias=True,
        groups=int(router.num_group or 1),
        top_groups=int(router.topk_group or 1),
        group_score="top2",
    )
    bias = f"{name}.e_score_correction_bias"
    return RouterReading(int(router.top_k), bool(router.norm_topk_prob), spec, f"{name}.weight", bias)


def _deepseek_v4(hashed: bool) -> Callable[[Any, str], RouterReading]:
    """DeepSeek-V4's routers: ``scoring_func`` scores (sqrt(softplus) or sigmoid), renormalised
    (``sum + 1e-20``) and scaled by ``routed_scaling_factor``; chosen by score + bias, or read from
    ``tid2eid`` by token id (``hashed``: the hash router, which has no bias)."""

    def read(block: Any, name: str) -> RouterReading:
        router = getattr(block, name)
        scores: dict[str, ScoreFunction] = {
            "SqrtSoftplusActivation": "sqrtsoftplus",
            "Sigmoid": "sigmoid",
            "SigmoidActivation": "sigmoid",
        }
        score = scores.get(type(router.score_fn).__name__)
        if score is None:
            raise ValueError(
                f"its scoring function {type(router.score_fn).__name__} is not sqrt(softplus) or sigmoid"
            )
        spec = RouterSpec(score=score, choice_bias=not hashed, scale=float(router.routed_scaling_factor))
        if hashed:
            return RouterReading(int(router.top_k), True, spec, f"{name}.weight", table=f"{name}.tid2eid")
        return RouterReading(
            int(router.top_k), True, spec, f"{name}.weight", f"{name}.e_score_correction_bias"
        )

    return read


ROUTER_KINDS: tuple[RouterKind, ...] = (
    RouterKind("softmax-top-k", "qwen3_moe.Qwen3MoeTopKRouter", "2a5d7542c840d638", _softmax(None)),
    RouterKind(
        "softmax-top-k", "lara_mini.LaraMiniTopKRouter", "4d19b824fc4d1a01", _softmax(None), float32=True
    ),
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
    RouterKind(
        "deepseek-v3", "deepseek_v3.DeepseekV3TopkRouter", "423d9ba5bcbc29ee", _deepseek_v3, float32=True
    ),
    RouterKind(
        "deepseek-v3", "minicpm5_moe.MiniCPM5MoeTopkRouter", "6c67854225de40a4", _deepseek_v3, float32=True
    ),
    RouterKind(
        "deepseek-v2", "deepseek_v2.DeepseekV2TopkRouter", "28548307e0e8b78a", _deepseek_v2, float32=True
    ),
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
        float32=True,
    ),
    RouterKind(
        "sigmoid + bias, scaled",
        "afmoe.AfmoeTokenChoiceRouter",
        "b679ac2f3ef704d3",
        _sigmoid(bias="expert_bias", scale="route_scale", weight="gate.weight"),
    ),
    RouterKind("sigmoid + bias", "laguna.LagunaTopKRouter", "a5c7b29ef9b9cf47", _laguna),
    RouterKind("sigmoid top-k", "flint.FlintTopKRouter", "c263946af55a5133", _flint, float32=True),
    RouterKind(
        "softmax + bias", "ernie4_5_moe.Ernie4_5_MoeTopKRouter", "4097eaeeeec9d3ab", _ernie, float32=True
    ),
    RouterKind("sigmoid of the top-k logits", "llama4.Llama4Router", "6059462df44bcda0", _llama4),
    RouterKind("softmax of the top-k logits", "aria.AriaTextTopKRouter", "db4ba175e9d6f201", _softmax(True)),
    RouterKind("softmax top-k, p-norm in the block", "dbrx.DbrxRouter", "54b5752f119b7342", _dbrx),
    RouterKind(
        "sigmoid + bias, scaled", "inkling2.Inkling2TopKRouter", "31734db132527195", _inkling2, float32=True
    ),
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
        refusal="PhiMoE's sparsemixer routing is not reproduced by a RouterSpec: in training it draws each "
        "of its 2 experts by Gumbel sampling among those within a jitter threshold of the best, weighs it "
        "by a softmax over that masked set with a Heun third-order gradient estimator; its block converts "
        "with the router kept as written (hf_moe_kept)",
    ),
    RouterKind(
        "sigmoid, by logits + bias", "kolibri1.Kolibri1TopKRouter", "a031a3a1ec09f295", _kolibri, float32=True
    ),
    RouterKind(
        "deepseek-v3, groups masked to 0.0", "axk2.AXK2TopkRouter", "7189c64fb391e00a", _axk2, float32=True
    ),
    RouterKind("sigmoid + block's bias, scaled", "lfm2_moe.Lfm2MoeTopKRouter", "986975a29bb20107", _lfm2),
    RouterKind("sigmoid + bias, scaled", "ergo.ErgoTopkRouter", "f62a003befb657d5", _ergo, float32=True),
    RouterKind(
        "sigmoid + bias, shared experts scored too",
        "inkling.InklingTopkRouter",
        "d60162986559217a",
        _inkling,
        float32=True,
    ),
    RouterKind(
        "softmax + bias, zero experts too",
        "longcat_flash.LongcatFlashTopkRouter",
        "e719a3b78df5fbe9",
        _longcat,
        float32=True,
    ),
    RouterKind(
        "softmax of the top-k logits",
        "jetmoe.JetMoeTopKGating",
        "f8d9cafa26f4062a",
        _softmax(True, "layer.weight"),
    ),
    RouterKind(
        "deepseek-v3, scaled on the block", "beam.BeamTopKRouter", "96ac29866ad23a29", _beam, float32=True
    ),
    RouterKind(
        "sqrt(softplus) + bias, scaled",
        "deepseek_v4.DeepseekV4TopKRouter",
        "72cb8c3ad271539b",
        _deepseek_v4(False),
    ),
    RouterKind(
        "hash by token id, sqrt(softplus) weights",
        "deepseek_v4.DeepseekV4HashRouter",
        "d7273b6db5f7ad35",
        _deepseek_v4(True),
    ),
)
