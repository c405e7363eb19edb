"""Hash routing (DeepSeek-V4's first layers): each token's experts read from a fixed table by
its token id, ``tid2eid [vocab, top_k]`` (int64; `TopKRouter`'s persistent buffer, loaded, never
trained), while the router's scores at those experts weigh them (`tessera.moe.router.route`'s
``chosen``). The ids travel with the tokens: an `MoE` layer takes them beside its input
(``MoE.forward(x, input_ids)``), each rank its own tokens' under expert parallelism.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["hash_choices", "hash_table"]


def hash_table(vocab: int, top_k: int) -> Tensor:
    """A table of ``vocab`` rows of ``top_k`` experts, zeros (every token to expert 0 until one
    is loaded, as ``transformers`` initialises DeepSeek-V4's)."""
    if vocab < 1:
        raise ValueError(f"a hash router's vocabulary (hash_vocab) must be >= 1, got {vocab}")
    return torch.zeros(vocab, top_k, dtype=torch.long)


def hash_choices(table: Tensor, input_ids: Tensor | None, tokens: int, experts: int) -> Tensor:
    """The ``[tokens, top_k]`` experts of ``input_ids`` (any shape of ``tokens`` ids, in the
    order of the tokens) read from ``table [vocab, top_k]``; ValueError naming the values when
    the ids are missing, do not number the tokens, or fall outside the table, or when the table
    names an expert outside ``[0, experts)``."""
    if input_ids is None:
        raise ValueError(
            "a hash-routed MoE layer (a tid2eid table) chooses each token's experts by its token id: "
            "call it with input_ids (MoE.forward(x, input_ids=...))"
        )
    if input_ids.numel() != tokens or input_ids.is_floating_point():
        raise ValueError(
            f"input_ids must hold one integer id per token: {tokens} tokens, got {input_ids.numel()} ids "
            f"of dtype {input_ids.dtype} (shape {tuple(input_ids.shape)})"
        )
    ids = input_ids.reshape(-1).to(device=table.device, dtype=torch.long)
    rows = table.shape[0]
    chosen = table[ids.clamp(0, rows - 1)]  # checked below with the ids: one read of 4 numbers
    if tokens:
        low, high, first, last = torch.stack([ids.min(), ids.max(), chosen.min(), chosen.max()]).tolist()
        if low < 0 or high >= rows:
            raise ValueError(f"input_ids in [{low}, {high}] fall outside the hash table's {rows} rows")
        if first < 0 or last >= experts:
            raise ValueError(f"the hash table names experts in [{first}, {last}], outside [0, {experts})")
    return chosen
