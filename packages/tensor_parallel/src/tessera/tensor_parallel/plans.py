"""Ready plans: Tessera's reference GPT, and Hugging Face transformers' GPT-2, Llama and Phi3.

Each is one plan of roles (``roles``, ``modes``) serving every tensor-parallel mode:
``plan_for_mode(PLAN, mode, model)`` gives the 2D, 2.5D or 3D plan; in 1D the plan is used
as it is, as described below (``head`` is a colwise LM head, ``norm`` a ``sequence_norm``,
``embedding`` a ``sequence_split`` embedding).

``GPT_PLAN`` (the reference GPT of ``tessera.models``, with or without sequence
parallelism): vocab-parallel token embedding; with SP the positional embedding keeps this
rank's positions; attention and MLP are regions with column-parallel q/k/v/fc_in and
row-parallel out_proj/fc_out; the LM head is column-parallel over the vocabulary and its
vocab-sharded logits go to ``vocab_parallel_cross_entropy`` (``parallel_gpt_loss``).

``GPT2_PLAN`` (``transformers.GPT2LMHeadModel``; importing this module does not import
transformers): the same layout for HF's fused ``c_attn`` (q|k|v) and ``Conv1D`` layers, the
LM head tied to the token embedding (the tie is kept). With sequence parallelism (HF builds
position ids and masks from the embedding's output and reshapes by the whole sequence after
``ln_f``): the embeddings' output stays whole (``vocab_whole``, ``embedding_whole``,
``dropout_whole``), the sequence is split at the first layer (``sequence_start``) and gathered
again by ``ln_f`` (``sequence_end``), so the LM head sees it whole (``colwise_whole``).

``LLAMA_PLAN`` (``transformers.LlamaForCausalLM``, and models with its module names: Mistral,
Qwen2/3 with ``attention_bias``): vocab-parallel ``embed_tokens``; attention a region with
column-parallel q/k/v_proj and row-parallel o_proj, its query heads split and its KV heads
split or, when fewer than tp, replicated (grouped-query and multi-query attention; see
``heads``); the SwiGLU MLP a region with column-parallel gate/up_proj and row-parallel
down_proj; RMSNorms replicated; ``lm_head`` column-parallel, its vocab-sharded logits for
``vocab_parallel_cross_entropy`` (pass no ``labels`` to the model). With sequence parallelism
the embedding's output stays whole (``vocab_whole``: HF derives positions, rotary embeddings
and the mask from it) and the sequence is split at the first layer (``sequence_start``).

``PHI3_PLAN`` (``transformers.Phi3ForCausalLM``): ``LLAMA_PLAN``'s layout for Phi3's fused
layers. Its ``qkv_proj`` (q|k|v, ``colwise_qkv``) is split by heads by the attention style: three
equal sections with as many KV heads as query heads, else parts of (heads, kv_heads, kv_heads)
whole heads, the KV part split or, when fewer than tp, replicated; each rank holds
``[q_r | k_r | v_r]``, as Phi3's forward splits it. Phi3 reads its query head count from its
config: the attention style gives each attention module a config copy with this rank's counts.
Its ``gate_up_proj`` (gate|up, ``colwise_gate_up``) is two equal sections each split, so each rank
holds ``[gate_r | up_r]``; the residual dropouts are ``dropout``.
"""

from __future__ import annotations

from torch import Tensor, nn

from tessera.comm import Group
from tessera.tensor_parallel.loss import vocab_parallel_cross_entropy
from tessera.tensor_parallel.plan import Plan, Style
from tessera.tensor_parallel.roles import Roles

__all__ = ["GPT2_PLAN", "GPT_PLAN", "LLAMA_PLAN", "PHI3_PLAN", "parallel_gpt_loss"]

GPT_PLAN = Plan.of(
    {
        "embed.tok": Style.VOCAB,
        "embed.pos": Roles.EMBEDDING,
        "embed.drop": Style.DROPOUT,
        "layers.*.ln1": Roles.NORM,
        "layers.*.attn": Style.ATTENTION,
        "layers.*.attn.q_proj": Style.COLWISE,
        "layers.*.attn.k_proj": Style.COLWISE,
        "layers.*.attn.v_proj": Style.COLWISE,
        "layers.*.attn.out_proj": Style.ROWWISE,
        "layers.*.attn.resid_drop": Style.DROPOUT,
        "layers.*.ln2": Roles.NORM,
        "layers.*.mlp": Style.REGION,
        "layers.*.mlp.fc_in": Style.COLWISE,
        "layers.*.mlp.fc_out": Style.ROWWISE,
        "layers.*.mlp.drop": Style.DROPOUT,
        "head.ln_f": Roles.NORM,
        "head.lm_head": Roles.HEAD,
    },
    name="tessera-gpt",
)

GPT2_PLAN = Plan.of(
    {
        "transformer.wte": Style.VOCAB_WHOLE,
        "transformer.wpe": Style.EMBEDDING_WHOLE,
        "transformer.drop": Style.DROPOUT_WHOLE,
        "transformer.h.0": Style.SEQUENCE_START,
        "transformer.h.*.ln_1": Roles.NORM,
        "transformer.h.*.attn": Style.ATTENTION,
        "transformer.h.*.attn.c_attn": Style.COLWISE_QKV,
        "transformer.h.*.attn.c_proj": Style.ROWWISE,
        "transformer.h.*.attn.attn_dropout": Style.DROPOUT_SPLIT,
        "transformer.h.*.attn.resid_dropout": Style.DROPOUT,
        "transformer.h.*.ln_2": Roles.NORM,
        "transformer.h.*.mlp": Style.REGION,
        "transformer.h.*.mlp.c_fc": Style.COLWISE,
        "transformer.h.*.mlp.c_proj": Style.ROWWISE,
        "transformer.h.*.mlp.dropout": Style.DROPOUT,
        "transformer.ln_f": Style.SEQUENCE_END,
        "lm_head": Style.COLWISE_WHOLE,
    },
    name="hf-gpt2",
)

LLAMA_PLAN = Plan.of(
    {
        "model.embed_tokens": Style.VOCAB_WHOLE,
        "model.layers.0": Style.SEQUENCE_START,
        "model.layers.*.input_layernorm": Roles.NORM,
        "model.layers.*.self_attn": Style.ATTENTION,
        "model.layers.*.self_attn.q_proj": Style.COLWISE,
        "model.layers.*.self_attn.k_proj": Style.COLWISE,
        "model.layers.*.self_attn.v_proj": Style.COLWISE,
        "model.layers.*.self_attn.o_proj": Style.ROWWISE,
        "model.layers.*.post_attention_layernorm": Roles.NORM,
        "model.layers.*.mlp": Style.REGION,
        "model.layers.*.mlp.gate_proj": Style.COLWISE,
        "model.layers.*.mlp.up_proj": Style.COLWISE,
        "model.layers.*.mlp.down_proj": Style.ROWWISE,
        "model.norm": Roles.NORM,
        "lm_head": Roles.HEAD,
    },
    name="hf-llama",
)

PHI3_PLAN = Plan.of(
    {
        "model.embed_tokens": Style.VOCAB_WHOLE,
        "model.layers.0": Style.SEQUENCE_START,
        "model.layers.*.input_layernorm": Roles.NORM,
        "model.layers.*.self_attn": Style.ATTENTION,
        "model.layers.*.self_attn.qkv_proj": Style.COLWISE_QKV,
        "model.layers.*.self_attn.o_proj": Style.ROWWISE,
        "model.layers.*.resid_attn_dropout": Style.DROPOUT,
        "model.layers.*.post_attention_layernorm": Roles.NORM,
        "model.layers.*.mlp": Style.REGION,
        "model.layers.*.mlp.gate_up_proj": Style.COLWISE_GATE_UP,
        "model.layers.*.mlp.down_proj": Style.ROWWISE,
        "model.layers.*.resid_mlp_dropout": Style.DROPOUT,
        "model.norm": Roles.NORM,
        "lm_head": Roles.HEAD,
    },
    name="hf-phi3",
)


def parallel_gpt_loss(model: nn.Module, idx: Tensor, targets: Tensor, group: Group) -> Tensor:
    """Mean next-token cross-entropy of a GPT parallelized with GPT_PLAN (its logits are
    vocab-sharded; they are never gathered). Equals the serial ``GPT.loss(idx, targets)``."""
    logits = model(idx)
    return vocab_parallel_cross_entropy(logits.flatten(0, -2), targets.flatten(), group)
