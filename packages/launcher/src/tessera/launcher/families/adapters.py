"""Models wrapped by PEFT: ``boost()`` trains the base model with its adapters in place.

``peft.get_peft_model(model, LoraConfig(...))`` returns a ``PeftModel`` around a
``LoraModel`` around the user's model, whose targeted layers now carry adapters
(``tessera.tensor_parallel.adapters``). For LoRA the two wrappers only pass the call on, so
``boost()`` takes the model inside (``PeftModel.get_base_model()``): its family, spec, plans
and pipeline blocks are the plain model's, and parameter names in checkpoints and
``Engine.full_state_dict()`` are its names (``model.layers.0.self_attn.q_proj.lora_A.default.
weight``), without PEFT's ``base_model.model.`` prefix. PEFT is recognised by its layout and is
not imported. Prompt-learning methods (prefix and prompt tuning), whose wrapper adds
inputs of its own, are refused.
"""

from __future__ import annotations

import logging

from torch import nn

__all__ = ["PEFT_PREFIX", "is_peft_model", "peft_config_of", "unwrap_peft"]

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the base model's names in its state dicts and adapter files."""


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT ``PeftModel`` (read by its layout: ``peft_config`` and
    ``get_base_model``)."""
    return isinstance(getattr(model, "peft_config", None), dict) and callable(
        getattr(model, "get_base_model", None)
    )


def peft_config_of(model: nn.Module) -> dict[str, object]:
    """A PEFT model's adapter configurations by adapter name (empty for any other model)."""
    found = getattr(model, "peft_config", None)
    return dict(found) if is_peft_model(model) and isinstance(found, dict) else {}


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The model ``boost()`` trains: a PEFT model's base model (its adapters in place), or
    ``model`` itself. ValueError for a prompt-learning adapter, whose wrapper changes the inputs."""
    if not is_peft_model(model):
        return model
    configs = peft_config_of(model)
    learned = [
        f"{name} ({getattr(kind, 'value', kind)})"
        for name, c in configs.items()
        if getattr(c, "is_prompt_learning", False) and (kind := getattr(c, "peft_type", "?"))
    ]
    if learned:
        raise ValueError(
            f"PEFT prompt-learning adapters {', '.join(learned)} add inputs in PeftModel's own forward, "
            "which boost() does not run; LoRA and other adapters on layers train"
        )
    base = model.get_base_model()  # type: ignore[operator]
    if not isinstance(base, nn.Module):
        raise TypeError(f"{type(model).__name__}.get_base_model() returned {type(base).__name__}")
    log.info(
        "boost: %s wraps %s with adapters %s: training it with its adapters in place (its names, without %r)",
        type(model).__name__,
        type(base).__name__,
        ", ".join(configs),
        PEFT_PREFIX,
    )
    return base
