"""Activation bytes a rank saves for backward in the reference GPT: the shared pieces and 1D.

Counted as ``tessera.comm.storage_bytes`` counts them: the distinct storages of the tensors
autograd saves during one forward of the loss (a ``saved_tensors_hooks`` pack hook, each
storage once, parameters excluded), for an fp32 model with dropout 0 (the reference GPT's
defaults) and torch's CPU flash-attention kernel (it saves q, k, v, the output and an fp32
log-sum-exp per query row and head; other kernels save other tensors). Each mode states two
numbers (``ActivationBytes``): the bytes of one transformer block, and those of the rest,
the embeddings, the final LayerNorm, the LM head and the loss. Symbols: B global batch,
S sequence, d hidden, H heads, r MLP ratio, V vocabulary, T the tokens of a rank's
activations, e = 4 (fp32).

1D (Megatron, ``GPT_PLAN``, tp = t, no sequence parallelism; every rank runs all T = B*S
tokens), per block::

    e T (4 d + (4 + 2r) d/t) + T (16 + 4 H/t)

the LayerNorms' inputs and the inputs of q/k/v and fc_in (kept whole: 4 e T d), q, k, v and
the attention output (4 e T d/t), the MLP's hidden before and after GELU (2 e T r d/t), the
two LayerNorms' fp32 mean and rstd (16 T) and the log-sum-exp (4 T H/t). Embedding and head::

    e T (2 d + V/t) + 27 T + 8 S + 8

the vocab embedding's local ids and mask (9 T), the position ids (8 S), ln_f's input and
statistics and the LM head's input (2 e T d + 8 T), and the loss: the softmax of this rank's
vocabulary columns (fp32, e T V/t), the local target ids and two masks (10 T) and the token
count (an int64: 8).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ActivationBytes", "E", "activation_bytes_1d", "attention_core_bytes", "loss_bytes"]

E = 4
"""Bytes of an fp32 element: the formulas are for an fp32 model."""


@dataclass(frozen=True, slots=True)
class ActivationBytes:
    """Bytes a rank saves for backward: ``block`` per transformer block, ``embed_head`` for
    the embeddings, final norm, LM head and loss together."""

    block: int
    embed_head: int

    def total(self, n_layers: int) -> int:
        """The whole model's: ``n_layers`` blocks plus the embedding and head."""
        if n_layers < 0:
            raise ValueError(f"n_layers must be >= 0, got {n_layers}")
        return n_layers * self.block + self.embed_head


def attention_core_bytes(tokens: int, local_hidden: int, local_heads: int) -> int:
    """Saved by the CPU flash-attention kernel for ``tokens`` query rows of ``local_heads``
    heads spanning ``local_hidden``: q, k, v and the output (4 e T d_local) and the fp32
    log-sum-exp per row and head (4 T H_local)."""
    return 4 * E * tokens * local_hidden + 4 * tokens * local_heads


def loss_bytes(tokens: int, local_vocab: int, count_bytes: int) -> int:
    """Saved by ``vocab_parallel_cross_entropy`` for ``tokens`` rows of ``local_vocab``
    columns: the fp32 softmax, the int64 local targets and two bool masks; plus the token
    count the mean divides by (``count_bytes``: 8 for an int64, 4 for an fp32 one)."""
    return 4 * tokens * local_vocab + 10 * tokens + count_bytes


def _need(value: int, n: int, what: str, where: str) -> None:
    if value < 1 or n < 1 or value % n:
        raise ValueError(f"{where}: {what}={value} is not a positive multiple of {n}")


def activation_bytes_1d(
    *, batch: int, seq: int, hidden: int, heads: int, vocab: int, tp: int, mlp_ratio: int = 4
) -> ActivationBytes:
    """The reference GPT's saved activation bytes per rank under ``GPT_PLAN`` at ``tp``
    (module docstring); ValueError naming the numbers unless tp divides heads and vocab."""
    where = "activation_bytes_1d"
    _need(heads, tp, "heads", where)
    _need(vocab, tp, "vocab", where)
    _need(hidden, heads, "hidden", where)
    t, d, r = tp, hidden, mlp_ratio
    tokens = batch * seq
    norm = E * tokens * d + 8 * tokens  # input, fp32 mean and rstd
    block = (
        2 * norm
        + 2 * E * tokens * d  # the inputs of q/k/v and fc_in, kept whole
        + attention_core_bytes(tokens, d // t, heads // t)
        + 2 * E * tokens * r * d // t  # fc_in's output (GELU input) and fc_out's input
    )
    embed = 9 * tokens + 8 * seq  # local ids and mask; position ids
    head = norm + E * tokens * d + loss_bytes(tokens, vocab // t, 8)
    return ActivationBytes(block=block, embed_head=embed + head)
