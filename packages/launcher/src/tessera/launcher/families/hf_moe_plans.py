"""Plans of roles for Hugging Face MoE families whose blocks ``hf_moe`` converts: each
family's attention, norms, embedding and head as tensor parallelism splits them, and each
layer's mixture replicated (``Roles.REPLICATE``): under tensor parallelism every tp rank runs
the whole mixture on the same tokens, so no expert is cut. A dense layer between MoE layers
(DeepSeek's ``first_k_dense_replace``, Qwen's ``mlp_only_layers``) sits under the same name and
is replicated too. The plans refuse sequence parallelism (a replicated mixture would see each
rank's slice of the sequence). A converted model whose plan gives its mixtures the ``moe``
style (`tessera.moe.split_hidden`) has every expert split over tp instead, and takes sequence
parallelism: so do the roles derived for a converted family with no plan here
(``derived_roles.derive_roles``).

- `MIXTRAL_PLAN`, `QWEN2_MOE_PLAN`, `QWEN3_MOE_PLAN`: ``LLAMA_PLAN``'s layout (Qwen3-MoE's
  per-head ``q_norm`` / ``k_norm`` stay whole inside the attention, their gradients summed
  over tp);
- `GRANITEMOE_PLAN`: the same attention, the mixture ``block_sparse_moe``; GraniteMoeShared's
  dense ``shared_mlp`` beside it is replicated too (an optional entry: a configuration with
  ``shared_intermediate_size = 0`` has none);
- `DEEPSEEK_PLAN` (DeepSeek-V2 and V3, multi-head latent attention): each rank holds its
  share of the heads of ``q_proj`` (or of ``q_b_proj`` after the query LoRA) and of
  ``kv_b_proj``, and of ``o_proj``'s input; the low-rank projections in front of them
  (``q_a_proj``, ``kv_a_proj_with_mqa``, which also makes the rotary key every head shares)
  and their norms stay whole, their gradients summed over tp.
"""

from __future__ import annotations

from collections.abc import Mapping

from tessera.tensor_parallel import LLAMA_PLAN, Plan, Style
from tessera.tensor_parallel.roles import Roles
from tessera.tensor_parallel.style import TPStyle

__all__ = [
    "DEEPSEEK_PLAN",
    "GRANITEMOE_PLAN",
    "GRANITEMOE_SHARED_PLAN",
    "MIXTRAL_PLAN",
    "QWEN2_MOE_PLAN",
    "QWEN3_MOE_PLAN",
]

_LLAMA = {p: s for p, s in LLAMA_PLAN.as_dict().items() if not p.startswith("model.layers.*.mlp")}


def _replicated(
    entries: Mapping[str, TPStyle], name: str, *mixtures: str, optional: tuple[str, ...] = ()
) -> Plan:
    """``entries`` with each of ``mixtures`` (patterns) replicated; no sequence parallelism."""
    replicated = {pattern: Roles.REPLICATE for pattern in mixtures}
    return Plan.of({**entries, **replicated}, name=name, supports_sequence_parallel=False, optional=optional)


MIXTRAL_PLAN = _replicated(_LLAMA, "hf-mixtral", "model.layers.*.mlp")
QWEN2_MOE_PLAN = _replicated(_LLAMA, "hf-qwen2-moe", "model.layers.*.mlp")
QWEN3_MOE_PLAN = _replicated(_LLAMA, "hf-qwen3-moe", "model.layers.*.mlp")
GRANITEMOE_PLAN = _replicated(_LLAMA, "hf-granitemoe", "model.layers.*.block_sparse_moe")
GRANITEMOE_SHARED_PLAN = _replicated(
    _LLAMA,
    "hf-granitemoe-shared",
    "model.layers.*.block_sparse_moe",
    "model.layers.*.shared_mlp",
    optional=("model.layers.*.shared_mlp",),  # not built where shared_intermediate_size = 0
)

_MLA: dict[str, TPStyle] = {
    "model.embed_tokens": Style.VOCAB_WHOLE,
    "model.layers.0": Style.SEQUENCE_START,
    "model.layers.*.input_layernorm": Roles.NORM,
    "model.layers.*.self_attn": Style.ATTENTION,
    "model.layers.*.self_attn.q_[pb]*": Style.COLWISE,  # q_proj, or q_b_proj after q_a_proj
    "model.layers.*.self_attn.kv_b_proj": Style.COLWISE,
    "model.layers.*.self_attn.o_proj": Style.ROWWISE,
    "model.layers.*.post_attention_layernorm": Roles.NORM,
    "model.norm": Roles.NORM,
    "lm_head": Roles.HEAD,
}
DEEPSEEK_PLAN = _replicated(_MLA, "hf-deepseek", "model.layers.*.mlp")
