"""What a Hugging Face model computes in fp32 whatever its dtype.

``transformers`` keeps some tensors of a family in fp32 when it loads the model in bf16 or fp16
(``_keep_in_fp32_modules_strict``: DeepSeek-V3's router weight ``gate.weight`` and its
``e_score_correction_bias``, Ergo's norms and embedding, ...) and some more in fp16 only
(``_keep_in_fp32_modules``), by patterns searched in each tensor's name (its ``dtype_plan``).
`kept_in_fp32` reads that plan of the model as the user built it and names the tensors ``boost()``
trains that it covers (a converted mixture's tensors by the HF tensors they export as), so that
they are computed in fp32 as transformers computes them (``ZeroOptimizer(keep_fp32=...)``).

A sparse block's routing weights, too, reach its experts in fp32 in some families (Mixtral's router
returns its fp32 softmax, DeepSeek-V3's computes in fp32) and in the model's dtype in others (Qwen's
casts them back): the experts' outputs are then weighed in fp32 and rounded once, or rounded twice.
`weighs_in_float32` reads which from the block's own forward (``tessera.moe.RouterSpec``'s
``weights_float32``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from tessera.launcher.checkpoint.exported import ExportPart, parts_of

__all__ = ["kept_in_fp32", "weighs_in_float32"]

log = logging.getLogger(__name__)


def kept_in_fp32(
    model: nn.Module,
    names: Iterable[str],
    exported: Mapping[str, tuple[ExportPart, ...]],
    dtype: torch.dtype,
) -> frozenset[str]:
    """Those of ``names`` (parameters and buffers of ``model``) that transformers keeps in fp32
    when it holds ``model`` in ``dtype``: a name whose HF tensors (``exported``'s parts, else
    itself) one of its dtype plan's patterns finds; none for a model that is not transformers'
    or for fp32."""
    plan = getattr(model, "_get_dtype_plan", None)
    if dtype == torch.float32 or not callable(plan):
        return frozenset()
    patterns = [p for p, held in plan(dtype).items() if held == torch.float32]
    if not patterns:
        return frozenset()
    from transformers.core_model_loading import build_glob_alternation

    found = build_glob_alternation(patterns)[0]
    return frozenset(n for n in names if any(found.search(p.name) for p in parts_of(n, exported)))


class _Handed(Exception):
    """Raised by the bank of a block's meta copy when the block calls it: what it was handed."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        super().__init__("the experts bank was called")
        self.args = args


def _stop(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    raise _Handed(args + tuple(kwargs.values()))


def weighs_in_float32(block: nn.Module, bank: nn.Module, d_model: int) -> bool:
    """Whether HF's sparse ``block``, computing in bf16, hands its experts ``bank`` (a submodule
    of it) the routing weights in fp32 (``bank(hidden_states, top_k_index, top_k_weights)``).
    Read from a forward of a copy of the block on the meta device in bf16 (nothing computed, no
    memory taken), stopped where it calls the bank. False (the model's dtype, as most families
    hand them) when that forward cannot run on the meta device or does not call the bank so."""
    memo: dict[int, Any] = {}
    for t in [*block.parameters(), *block.buffers()]:
        dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
        meta = torch.empty(t.shape, dtype=dtype, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    twin = copy.deepcopy(block, memo)
    path = next(n for n, m in block.named_modules() if m is bank)
    twin.get_submodule(path).register_forward_pre_hook(_stop, with_kwargs=True)
    x = torch.empty(1, 4, d_model, dtype=torch.bfloat16, device="meta")
    try:
        twin(x)
    except _Handed as handed:
        weights = handed.args[2] if len(handed.args) == 3 else None
        return isinstance(weights, torch.Tensor) and weights.dtype == torch.float32
    except Exception as exc:  # a forward the meta device cannot run: the model's dtype
        log.debug("%s: no meta forward (%s): routing weights in the model's dtype", type(block), exc)
    return False
