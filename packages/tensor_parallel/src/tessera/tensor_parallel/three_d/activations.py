"""Activation bytes a rank saves for backward in the reference GPT under ``GPT_3D_PLAN``.

Counted as ``tessera.tensor_parallel.activations`` says (distinct storages, parameters
excluded, fp32, dropout 0, CPU flash attention; e = 4). Both layouts give a rank
T = B*S/q^2 tokens of a d/q-wide hidden block. Each ``Linear3D`` keeps its all-gathered
input (q T tokens: e q T in/q) and all-gathered weight (e out/q in/q) for backward, as
Colossal-AI's does; q, k and v gather the same input separately. Per block::

    e T d/q (6 + r + q (5 + r)) + T (8 + 4 H/q) + 2 e d/q + e (d/q)^2 (4 + 2r)

the two LayerNorms (fp32 normalised input and rstd, e T d/q + 4 T, and the weight
all-gathered to hidden block h, e d/q); q, k, v and the attention output (4 e T d/q) and
log-sum-exp (4 T H/q); the MLP's hidden after fc_in (the GELU input, e T r d/q); the
gathered inputs of q, k, v, out_proj (4 e q T d/q), fc_in (e q T d/q) and fc_out
(e q T r d/q) and the gathered weights: four d/q x d/q, and two of r d/q x d/q. Embedding
and head::

    e T (d/q + V/q) + e q T d/q + e V/q d/q + 14 T + e d/q + 8 B S + 8 S + 4

ln_f, the LM head's gathered input and weight, the loss (fp32 softmax of vocabulary block
a, e T V/q; local targets and two masks, 10 T; the fp32 token count, 4), the position ids
(8 S) and the token ids, 8 B S: a rank's batch block is a view of the global batch it was
handed, so its storage is the whole batch's.
"""

from __future__ import annotations

from tessera.tensor_parallel.activations import ActivationBytes, E, attention_core_bytes, loss_bytes
from tessera.tensor_parallel.three_d.cube import check_cube_divisible

__all__ = ["activation_bytes_3d"]


def activation_bytes_3d(
    *, batch: int, seq: int, hidden: int, heads: int, vocab: int, q: int, mlp_ratio: int = 4
) -> ActivationBytes:
    """The reference GPT's saved activation bytes per rank under ``GPT_3D_PLAN`` on a
    q x q x q cube (module docstring); ValueError naming the numbers unless q^2 divides
    batch and q divides heads, vocab and hidden."""
    where = "activation_bytes_3d"
    check_cube_divisible(batch, q * q, what="batch", where=where)
    for what, size in (("heads", heads), ("vocab", vocab), ("hidden", hidden)):
        check_cube_divisible(size, q, what=what, where=where)
    d, r, t = hidden // q, mlp_ratio, batch * seq // (q * q)

    def gathered(n_in: int, n_out: int) -> int:  # a Linear3D's saved input and weight
        return E * q * t * n_in + E * n_in * n_out

    norm = E * t * d + 4 * t + E * d
    block = (
        2 * norm
        + 3 * gathered(d, d)  # q, k, v
        + attention_core_bytes(t, d, heads // q)
        + gathered(d, d)  # out_proj
        + gathered(d, r * d)  # fc_in
        + E * t * r * d  # fc_in's output, the GELU input
        + gathered(r * d, d)  # fc_out
    )
    ids = 8 * batch * seq + 8 * seq
    head = norm + gathered(d, vocab // q) + loss_bytes(t, vocab // q, 4)
    return ActivationBytes(block=block, embed_head=ids + head)
