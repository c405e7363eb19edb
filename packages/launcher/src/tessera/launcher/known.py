"""The `ModelSpec` of every model Tessera knows by class: the reference GPT, Hugging Face
``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``
(their experts whole on every tp rank: ``hf_moe``), each with one plan of roles serving every
tensor-parallel mode. They use the same contract as a user's model;
``boost()`` finds them with ``model_spec(model)``. Registered by dotted class name, so no
model library is imported until a model of it is boosted.
"""

from __future__ import annotations

from tessera.launcher.hf import gpt2_blocks, llama_blocks
from tessera.launcher.hf_moe import MIXTRAL_PLAN, QWEN2_MOE_PLAN
from tessera.launcher.spec import ModelSpec, register_model_spec
from tessera.tensor_parallel import GPT2_PLAN, GPT_PLAN, LLAMA_PLAN

__all__ = ["GPT2_SPEC", "LLAMA_SPEC", "MIXTRAL_SPEC", "QWEN2_MOE_SPEC", "REFERENCE_GPT_SPEC"]

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
