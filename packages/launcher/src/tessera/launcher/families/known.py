"""The `ModelSpec` of every model Tessera knows: by class, the reference GPT, Hugging Face
``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``
(their experts whole on every tp rank: ``hf_moe``), each with one plan of roles serving every
tensor-parallel mode; by Hugging Face family (``config.model_type``), every decoder-only
family of the pinned ``transformers`` listed in `FAMILIES`, whose roles are derived from the
model's module tree (``derived_roles``), or for the MoE families whose blocks ``hf_moe``
converts (Qwen3-MoE, DeepSeek-V2/V3, GraniteMoE, GraniteMoeShared) written in ``hf_moe_plans``
with each mixture replicated, and whose pipeline blocks are ``hf.decoder_blocks``.

They use the same contract as a user's model; ``boost()`` finds them with
``model_spec(model)``. Registered by dotted class name or model type, so no model library is
imported until a model of it is boosted. A family that cannot take a parallel axis says so in
``ModelSpec.refuses``, and ``boost()`` refuses it before building anything.
"""

from __future__ import annotations

from torch import nn

from tessera.launcher.families.hf import decoder_blocks, gpt2_blocks, llama_blocks, opt_blocks
from tessera.launcher.families.hf_moe_plans import (
    DEEPSEEK_PLAN,
    GRANITEMOE_PLAN,
    GRANITEMOE_SHARED_PLAN,
    MIXTRAL_PLAN,
    QWEN2_MOE_PLAN,
    QWEN3_MOE_PLAN,
)
from tessera.launcher.families.spec import ModelSpec, register_model_family, register_model_spec
from tessera.tensor_parallel import GPT2_PLAN, GPT_PLAN, LLAMA_PLAN

__all__ = ["FAMILIES", "GPT2_SPEC", "LLAMA_SPEC", "MIXTRAL_SPEC", "QWEN2_MOE_SPEC", "REFERENCE_GPT_SPEC"]

REFERENCE_GPT_SPEC = ModelSpec(
    roles=GPT_PLAN,
    attention_cores="layers.*.attn.core",
    positions="embed.pos",
)
GPT2_SPEC = ModelSpec(roles=GPT2_PLAN, blocks=gpt2_blocks)
LLAMA_SPEC = ModelSpec(roles=LLAMA_PLAN, blocks=llama_blocks)
MIXTRAL_SPEC = ModelSpec(roles=MIXTRAL_PLAN, blocks=llama_blocks)
QWEN2_MOE_SPEC = ModelSpec(roles=QWEN2_MOE_PLAN, blocks=llama_blocks)

register_model_spec("tessera.models.gpt.GPT", REFERENCE_GPT_SPEC)
register_model_spec("transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel", GPT2_SPEC)
register_model_spec("transformers.models.llama.modeling_llama.LlamaForCausalLM", LLAMA_SPEC)
register_model_spec("transformers.models.mixtral.modeling_mixtral.MixtralForCausalLM", MIXTRAL_SPEC)
register_model_spec("transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeForCausalLM", QWEN2_MOE_SPEC)

_ALIBI = (
    "its attention biases (ALiBi) are built in the model's forward for every head and the whole sequence, "
    "which a split of the heads, a pipeline stage and a sequence shard do not see"
)


def _doge_mixture(model: nn.Module) -> dict[str, str]:
    """Doge's product-key mixture (``is_moe``) routes each token by logits of two others: its
    router's ``view(2, tokens, -1)`` pairs rows of the whole batch, so any split of it changes
    every choice (at dp=2 the first loss is 4e-3 off the serial step's)."""
    if not getattr(getattr(model, "config", None), "is_moe", False):
        return {}
    return {
        "batch": "its mixture (is_moe) routes each token by the logits of two other tokens of the batch "
        "(its router's view(2, tokens, -1)), so a forward of part of the batch chooses other experts "
        "than the whole step's: train it with dp=1, cp=1 and parallel.microbatches=1"
    }


_EMBEDDINGS_BESIDE = (
    "its hybrid layers take the embeddings' output (original_hidden_states) beside the hidden states, "
    "and a pipeline stage receives the hidden states alone"
)


# model_type -> spec: the decoder-only causal-LM families of the pinned transformers whose
# layout the derived roles and ``decoder_blocks`` serve (tests/test_hf_families.py holds each to
# its serial run), and those refused an axis, with the reason.
_ROTARY = (
    "cohere", "falcon", "gemma", "gemma2", "gemma3_text", "gpt_neox", "gptj", "granite",
    "mistral", "olmo", "phi", "phi3", "qwen2", "qwen3", "stablelm", "starcoder2",
)  # fmt: skip
FAMILIES: dict[str, ModelSpec] = {
    **{kind: ModelSpec(blocks=decoder_blocks) for kind in _ROTARY},
    "bloom": ModelSpec(refuses={"tp": _ALIBI, "pp": _ALIBI, "cp": _ALIBI}),
    "doge": ModelSpec(
        blocks=decoder_blocks,
        refuses={
            "pp": "its causal mask is made with allow_is_causal_skip=False, its dynamic mask added onto "
            "it, where the pipeline's blocks make the default mask (None under SDPA): its stages do not "
            "reproduce its serial step (verify=True finds the loss 9e-4 off at the first step)"
        },
        refused_by=_doge_mixture,
    ),
    "opt": ModelSpec(blocks=opt_blocks),
    # MoE families (convert their blocks with hf_moe.convert_hf_moe; tests/test_hf_moe_families.py)
    "qwen3_moe": ModelSpec(roles=QWEN3_MOE_PLAN, blocks=decoder_blocks),
    "deepseek_v2": ModelSpec(roles=DEEPSEEK_PLAN, blocks=decoder_blocks),
    "deepseek_v3": ModelSpec(roles=DEEPSEEK_PLAN, blocks=decoder_blocks),
    "granitemoe": ModelSpec(roles=GRANITEMOE_PLAN, blocks=decoder_blocks),
    "granitemoeshared": ModelSpec(roles=GRANITEMOE_SHARED_PLAN, blocks=decoder_blocks),
    # their q_norm and k_norm normalize each whole projection (all heads together): the derived
    # roles keep the attention whole on every tp rank (and refuse sequence parallelism)
    "zamba": ModelSpec(blocks=decoder_blocks, refuses={"pp": _EMBEDDINGS_BESIDE}),
    "zamba2": ModelSpec(blocks=decoder_blocks, refuses={"pp": _EMBEDDINGS_BESIDE}),
    "olmoe": ModelSpec(blocks=decoder_blocks),
    "olmo2": ModelSpec(blocks=decoder_blocks),
    # its pipeline blocks apply its own input_hidden_states_scale and _bias (hf_base_parameters), give
    # each layer its dict of masks (hf_layout.masks_by_key) and carry its router state, handed to each
    # layer by position (hf_streams.carried_between_layers): tests/test_hf_pp_zaya.py
    "zaya": ModelSpec(blocks=decoder_blocks),
}

# any other HF family: the rotary decoder's blocks, which boost() checks against the model's
# logits before partitioning (a family they do not fit is refused there, naming the block)
FAMILIES["*"] = ModelSpec(blocks=decoder_blocks)

for _kind, _spec in FAMILIES.items():
    register_model_family(_kind, _spec)
