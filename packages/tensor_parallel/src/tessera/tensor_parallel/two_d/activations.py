"""Activation bytes a rank saves for backward in the reference GPT under ``GPT_2D_PLAN``.

Counted as ``tessera.tensor_parallel.activations`` says (distinct storages, parameters
excluded, fp32, dropout 0, CPU flash attention; e = 4). Rank (i, j) holds T = B*S/q tokens
(batch block i) of hidden block j, d/q wide. Per block::

    e T d/q (8 + 2r) + T (8 + 4 H/q) + 2 e d/q

each LayerNorm's fp32 normalised input and rstd (e T d/q + 4 T) and its weight all-gathered
along the column (e d/q, held for the product); the LayerNorm outputs, which SUMMA keeps
as the local blocks of q/k/v's and fc_in's input (2 e T d/q; nothing broadcast is kept,
backward broadcasts again); q, k, v and the attention output (4 e T d/q) and the
log-sum-exp (4 T H/q); the MLP's hidden before and after GELU (2 e T r d/q). Embedding and
head::

    e T (2 d/q + V/q) + 14 T + e d/q + 8 B S + 8 S + 4

ln_f (e T d/q + 4 T + e d/q) and the LM head's input (e T d/q), the loss (fp32 softmax of
vocabulary block j, e T V/q; local targets and two masks, 10 T; the fp32 token count, 4),
the position ids (8 S) and the token ids, 8 B S: a rank's batch block is a view of the
global batch it was handed, so its storage is the whole batch's.
"""

from __future__ import annotations

from tessera.tensor_parallel.activations import ActivationBytes, E, attention_core_bytes, loss_bytes
from tessera.tensor_parallel.two_d.grid import check_grid_divisible

__all__ = ["activation_bytes_2d", "summa_activation_bytes"]


def summa_activation_bytes(
    *, tokens: int, batch: int, seq: int, hidden: int, heads: int, vocab: int, q: int, mlp_ratio: int = 4
) -> ActivationBytes:
    """The formula of the module for a rank holding ``tokens`` tokens of a q x q grid's layout
    (2D: B*S/q; 2.5D: B*S/(q d)); ``batch`` and ``seq`` size the global ids it is handed."""
    d, r, t = hidden // q, mlp_ratio, tokens
    norm = E * t * d + 4 * t + E * d  # fp32 normalised input, rstd, gathered weight
    block = (
        2 * norm
        + 2 * E * t * d  # the LayerNorm outputs: SUMMA's local input blocks
        + attention_core_bytes(t, d, heads // q)
        + 2 * E * t * r * d  # fc_in's output (GELU input) and fc_out's input
    )
    ids = 8 * batch * seq + 8 * seq
    head = norm + E * t * d + loss_bytes(t, vocab // q, 4)
    return ActivationBytes(block=block, embed_head=ids + head)


def activation_bytes_2d(
    *, batch: int, seq: int, hidden: int, heads: int, vocab: int, q: int, mlp_ratio: int = 4
) -> ActivationBytes:
    """The reference GPT's saved activation bytes per rank under ``GPT_2D_PLAN`` on a q x q
    grid (module docstring); ValueError naming the numbers unless q divides batch, heads,
    vocab and hidden."""
    for what, size in (("batch", batch), ("heads", heads), ("vocab", vocab), ("hidden", hidden)):
        check_grid_divisible(size, q, what=what, where="activation_bytes_2d")
    return summa_activation_bytes(
        tokens=batch * seq // q,
        batch=batch,
        seq=seq,
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        q=q,
        mlp_ratio=mlp_ratio,
    )
