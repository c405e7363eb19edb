"""``boost(..., verify="twin")``: verify the layout on a shrunken twin of a Hugging Face model.

``verify=True`` compares the first step with a serial step of the model itself, which needs a
serial copy of the whole model on every rank: out of reach for the models that need
parallelism most. The twin is the same model class built from the same config with few
layers and small widths (`shrunken_config`): every head count, the vocabulary's split, the
layer types, windows, scales and tied weights stay as they are, so the twin takes the same
plan of roles, pipeline blocks, probes and degrees. ``boost`` builds it (same seed on every
rank), boosts it with ``verify=True`` under the same config, trains one step on a random
batch (one row per replica and microbatch, 16 tokens per cp rank), which the verifier
compares with the serial step of a copy of the twin, and drops it, all before the real
model is touched. A mismatch raises the verifier's ``ValueError`` on every rank.

Cost, logged at INFO: building the twin, its boost and one verified step, a few seconds at
most for a twin of 2-4 layers of width ``8 * heads``; memory: the twin and its serial copy.
What the twin cannot see: a fault that depends on the real widths or depth alone (a shape
that divides at one size and not the other is refused by the real model's own checks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["shrunken_config", "shrunken_twin", "twin_batch"]

log = logging.getLogger(__name__)

_WIDTH = 8  # each head's width in the twin
_WIDTH_KEYS = (
    "intermediate_size",
    "ffn_dim",
    "n_inner",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def shrunken_config(config: Any, *, layers: int, vocab_multiple: int) -> Any:
    """A copy of a Hugging Face ``config`` with ``layers`` layers, heads ``_WIDTH`` wide (every
    head count kept), MLP widths of four times the hidden width, and a vocabulary of 64 rows
    per ``vocab_multiple`` (token ids beyond it dropped); every other setting kept."""
    values = config.to_dict()
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    if heads <= 0:
        raise ValueError(f"verify='twin': {type(config).__name__} does not say its number of attention heads")
    hidden = heads * _WIDTH
    changes: dict[str, Any] = {"num_hidden_layers": layers, "hidden_size": hidden}
    if values.get("head_dim") is not None:
        changes["head_dim"] = _WIDTH
    for key in _WIDTH_KEYS:
        if values.get(key):
            changes[key] = 4 * hidden
    vocab = 64 * vocab_multiple
    if int(getattr(config, "vocab_size", vocab)) > vocab:
        changes["vocab_size"] = vocab
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(values.get(key), int) and values[key] >= vocab:
                changes[key] = None
    if isinstance(values.get("layer_types"), list):
        changes["layer_types"] = values["layer_types"][:layers]
    # the config's own names for these (attribute_map: GPT-2's n_embd, n_layer, ...)
    mapping = getattr(config, "attribute_map", {})
    return type(config)(**{**values, **{mapping.get(k, k): v for k, v in changes.items()}})


def shrunken_twin(model: nn.Module, *, layers: int, vocab_multiple: int, seed: int) -> nn.Module:
    """The model's class built from `shrunken_config` of its config, its weights drawn from
    ``seed`` (the same on every rank; the caller's random state is left as it was)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(
            f"verify='twin' builds the twin from a Hugging Face config; {type(model).__name__} has none: "
            "use verify=True (a serial copy of the model itself)"
        )
    small = shrunken_config(config, layers=layers, vocab_multiple=vocab_multiple)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        twin: nn.Module = type(model)(small)
    like = next(iter(model.parameters()))
    if not like.is_meta:
        twin = twin.to(like.device)
    return twin


def twin_batch(vocab: int, *, rows: int, tokens: int, seed: int, device: torch.device) -> tuple[Any, Any]:
    """Random ``(inputs, targets)`` of ``rows`` x ``tokens`` token ids below ``vocab``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, tokens + 1), generator=gen).to(device)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def timed(what: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` and log how long ``what`` took."""
    start = time.perf_counter()
    fn()
    log.info("%s took %.2f s", what, time.perf_counter() - start)


def twin_width(twin: nn.Module) -> int:
    """The twin's hidden width (for the log)."""
    return int(getattr(getattr(twin, "config", None), "hidden_size", 0))
