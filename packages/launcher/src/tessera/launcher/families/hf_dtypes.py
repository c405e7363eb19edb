"""What a Hugging Face model computes in fp32 whatever its dtype.

``transformers`` keeps some tensors of a family in fp32 when it loads the model in bf16 or fp16
(``_keep_in_fp32_modules_strict``: DeepSeek-V3's router weight ``gate.weight`` and its
``e_score_correction_bias``, Ergo's norms and embedding, ...) and some more in fp16 only
(``_keep_in_fp32_modules``), by patterns searched in each tensor's name (its ``dtype_plan``).
`kept_in_fp32` reads that plan of the model as the user built it and names the tensors ``boost()``
trains that it covers (a converted mixture's tensors by the HF tensors they export as), so that
they are computed in fp32 as transformers computes them (``ZeroOptimizer(keep_fp32=...)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from tessera.launcher.checkpoint.exported import ExportPart, parts_of

__all__ = ["kept_in_fp32"]


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
