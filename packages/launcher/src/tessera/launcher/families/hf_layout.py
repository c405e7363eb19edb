"""What ``hf.decoder_blocks`` reads of a Hugging Face model: its base model, the modules it runs
before and after its layers (in the order its forward applies them), each layer's kind, mask,
rotary module and attention modules, and what its layers take beside the hidden states that no
pipeline stage receives (refused, naming it) or that its forward keeps for them
(`tessera.launcher.families.hf_streams`) or makes from its inputs
(`tessera.launcher.families.hf_beside`). Importing this module does not import transformers.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any

from torch import Tensor, nn

from tessera.launcher.families.hf_streams import applied_order, kept_between_layers, layer_calls

__all__ = [
    "applied_after",
    "attentions_of",
    "base_of",
    "is_nope",
    "is_rotary",
    "kept_for_layers",
    "layer_type",
    "mask_function",
    "mask_of",
    "masks_by_key",
    "module_function",
    "nope_scale",
    "order",
    "rotary_of",
    "taken_beside",
    "used",
]

_NOPE_SCALE = "compute_attention_scaling"  # Beam's query scale of its NoPE layers, from the positions


def layer_type(config: Any, index: int) -> str:
    """Layer ``index``'s kind: ``config.layer_types[index]``, else sliding or full attention."""
    types = getattr(config, "layer_types", None)
    if types:
        return str(types[index])
    window = getattr(config, "sliding_window", None)
    return "sliding_attention" if window and getattr(config, "use_sliding_window", True) else "full_attention"


def mask_function(kind: str) -> Any:
    """What the model builds the mask of a layer of ``kind`` with: ``transformers``' own table of
    layer kinds (a recurrent layer's padding mask, None unpadded; the DSA indexer's causal mask
    made whole, not left to SDPA's ``is_causal``), else a sliding window or causal mask."""
    masks = importlib.import_module("transformers.masking_utils")  # optional: reached untyped
    made = getattr(masks, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {}).get(kind)
    if callable(made):
        return made
    if "sliding" in kind:  # sliding_attention, Inkling's hybrid_sliding
        return masks.create_sliding_window_causal_mask
    return masks.create_causal_mask


def mask_of(config: Any, kind: str, keys: Mapping[str, str | None], h: Tensor, positions: Tensor) -> Any:
    """What a layer of ``kind`` is given as its ``attention_mask`` for hidden states ``h`` (the
    whole sequence, no padding): the mask of its kind (`mask_function`), or where its model hands it
    a dict of masks (``keys``, `masks_by_key`), that dict, each key's mask of its kind."""

    def made(of: str) -> Any:
        return mask_function(of)(config, h, None, None, position_ids=positions)

    return {key: made(of or kind) for key, of in keys.items()} if keys else made(kind)


def _kind_of(value: ast.expr) -> tuple[bool, str | None]:
    """Which mask a dict entry looks up in the model's masks by kind: ``masks["conv"]`` and
    ``masks.get("conv")`` that kind's, ``masks[<a variable>]`` the layer's own (None); (False,
    None) for another expression."""
    if isinstance(value, ast.Subscript):
        key = value.slice.value if isinstance(value.slice, ast.Constant) else None
        return True, key if isinstance(key, str) else None
    is_get = (
        isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "get"
    )
    first = value.args[0] if isinstance(value, ast.Call) and len(value.args) == 1 else None
    if is_get and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return True, first.value
    return False, None


def masks_by_key(fn: Callable[..., Any], stack: str) -> dict[str, str | None]:
    """The dict of masks the forward ``fn`` hands each layer of ``self.<stack>`` as its
    ``attention_mask``, key -> the kind of mask it looks up (None: the layer's own kind; ZAYA's
    ``{"causal": None, "conv": "conv"}`` from ``{"causal": causal_mask_mapping[layer_type], "conv":
    causal_mask_mapping.get("conv")}``); {} when it hands a mask, not a dict. An entry read otherwise
    is a ValueError naming it."""
    keys: dict[str, str | None] = {}
    for call, _, _ in layer_calls(fn, stack):
        given = next((k.value for k in call.keywords if k.arg == "attention_mask"), None)
        if not isinstance(given, ast.Dict):
            continue
        for key, value in zip(given.keys, given.values, strict=True):
            read, kind = _kind_of(value)
            if not isinstance(key, ast.Constant) or not isinstance(key.value, str) or not read:
                entry = f"{ast.unparse(key) if key is not None else '**'}: {ast.unparse(value)}"
                raise ValueError(
                    f"the forward hands its layers a dict of masks whose entry {{{entry}}} the pipeline "
                    "blocks do not read (only masks[kind], masks.get(kind) and masks[<the layer's kind>])"
                )
            keys[key.value] = kind
    return keys


_ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")


def attentions_of(layer: nn.Module) -> list[nn.Module]:
    """The layer's attention modules: a child whose class name says Attention, or the members of
    a ModuleList child that are or that is named so (LongCat-Flash's two ``self_attn`` per
    layer); none for a layer whose mixer is another (Mamba, gated delta net, short convolution).
    A child of those names first (Inkling 2's ``self_attn``, not its block attention residuals)."""
    by_name = [
        m
        for n, m in layer.named_children()
        if n in _ATTENTION_NAMES and "attention" in type(m).__name__.lower()
    ]
    if len(by_name) == 1:
        return by_name
    for name, sub in layer.named_children():
        if "attention" in type(sub).__name__.lower():
            return [sub]
        members = list(sub) if isinstance(sub, nn.ModuleList) else []
        named = name in _ATTENTION_NAMES or all("attention" in type(m).__name__.lower() for m in members)
        if members and named:
            return members
    return []


def rotary_of(base: nn.Module, config: Any, index: int) -> nn.Module | None:
    """The rotary module of layer ``index``: the base model's ``rotary_emb`` (or its one rotary
    child under another name, LFM2's ``pos_emb``), or where it keeps one per base frequency
    (GraniteMoE-SWA's ``rotary_embs``, chosen by ``config.layer_rope_theta``; 0: no rotary),
    the one of the layer's frequency."""
    thetas = getattr(config, "layer_rope_theta", None)
    rotaries = getattr(base, "rotary_embs", None)
    if thetas is None or not isinstance(rotaries, nn.ModuleList):
        rotary = getattr(base, "rotary_emb", None)
        if isinstance(rotary, nn.Module):
            return rotary
        named = [m for m in base.children() if is_rotary(m) and not isinstance(m, nn.ModuleList)]
        return named[0] if len(named) == 1 else None  # under another name (LFM2's pos_emb)
    theta = thetas[index]
    if not theta:
        return None
    for rotary in rotaries:
        parameters = getattr(getattr(rotary, "config", None), "rope_parameters", None) or {}
        if parameters.get("rope_theta") == theta:
            return rotary
    raise ValueError(f"{type(base).__name__} has no rotary module of base {theta} for layer {index}")


# what a family's layers take beside the hidden states, made before the layers or by the layer
# before: none of it reaches a pipeline stage, but what `hf_beside` carries (Gemma's)
_CARRIED = {
    "original_hidden_states": "the embeddings' output (original_hidden_states)",
    "per_layer_input": "per-layer embeddings of the token ids (per_layer_input)",
    "shared_kv_states": "keys and values of earlier layers (shared_kv_states)",
}
# those a family's layers take only when its config switches them on (Gemma's)
_SWITCHED = {"per_layer_input": "hidden_size_per_layer_input", "shared_kv_states": "num_kv_shared_layers"}


def taken_beside(signature: inspect.Signature, config: Any, handled: Collection[str] = ()) -> str:
    """What of `_CARRIED` a layer of this signature is given by its model and the blocks do not
    carry (``handled``: what `hf_beside` carries), as words (Zamba's embeddings' output; per-layer
    embeddings or shared keys and values, where its config has them, of a model not read as
    Gemma's); "" when nothing."""
    names = [
        n
        for n in _CARRIED
        if n in signature.parameters
        and n not in handled
        and (n not in _SWITCHED or bool(getattr(config, _SWITCHED[n], None)))
    ]
    return " and ".join(_CARRIED[n] for n in names)


def is_nope(config: Any, kind: str) -> bool:
    """Whether layers of ``kind`` take no rotary embeddings (``config.rope_parameters[kind]`` is
    None: Beam's and Ergo's full-attention layers)."""
    per_type = getattr(config, "rope_parameters", None)
    return isinstance(per_type, dict) and kind in per_type and per_type[kind] is None


def module_function(layer: nn.Module, name: str) -> Any:
    """The function ``name`` of the layer's modeling module, or None."""
    found = getattr(importlib.import_module(type(layer).__module__), name, None)
    return found if callable(found) else None


def nope_scale(layer: nn.Module) -> Any:
    """The query scale a NoPE layer's attention takes (``attention_scaling``), where its family's
    modeling module has one (Beam's ``compute_attention_scaling``: positions -> scale); else
    None: the layer is given ``position_embeddings=None`` alone, as Ergo's model gives it (a
    family doing otherwise fails ``check_blocks`` before anything is partitioned)."""
    scale = getattr(importlib.import_module(type(layer).__module__), _NOPE_SCALE, None)
    return scale if callable(scale) else None


def used(base: nn.Module, config: Any, name: str) -> Any:
    """``config.<name>`` where the base model's forward reads it (Granite's ``embedding_multiplier``),
    else None (Inkling's config holds one that its forward does not apply)."""
    value = getattr(config, name, None)
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return value
    return value if name in source else None


def base_of(model: nn.Module) -> nn.Module:
    """The base model under the head: the child ``base_model_prefix`` names, else ``model`` (Llama
    4's text model names its prefix ``language_model`` and keeps its base as ``model``)."""
    prefix = getattr(model, "base_model_prefix", "")
    for name in (prefix, "model"):
        base = getattr(model, name, None) if name else None
        if isinstance(base, nn.Module):
            return base
    return model


def is_rotary(module: nn.Module) -> bool:
    """A rotary module, or a list of them (GraniteMoE-SWA's ``rotary_embs``, one per base frequency)."""
    if isinstance(module, nn.ModuleList):
        return len(module) > 0 and all(is_rotary(m) for m in module)
    return "rotary" in type(module).__name__.lower()


def order(base: nn.Module, stack: str) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules the base model runs before and after its layers: ``config.base_model_pp_plan``'s
    order where the model has one (Phi registers its embedding dropout after its layers), else
    registration order; rotary modules (called with positions, not chained) are left out."""
    config: Any = getattr(base, "config", None)
    pp_plan = getattr(config, "base_model_pp_plan", None)
    names = list(pp_plan) if pp_plan else [n for n, _ in base.named_children()]
    if stack not in names:
        raise ValueError(f"{type(base).__name__}'s layers {stack!r} are not among its stages {names}")
    at = names.index(stack)

    def modules(part: list[str]) -> list[nn.Module]:
        return [base.get_submodule(n) for n in part if not is_rotary(base.get_submodule(n))]

    return modules(names[:at]), modules(applied_after(base, stack) or names[at + 1 :])


def applied_after(base: nn.Module, stack: str) -> list[str]:
    """The children the base model's forward applies after its layers, in that order (HunYuan-V4's
    ``self.norm(self.hc_head(h))``: ``hc_head``, ``norm``); [] where its forward is not readable."""
    applied = applied_order(type(base).forward)
    if stack not in applied:
        return []
    children = dict(base.named_children())
    later = applied[len(applied) - applied[::-1].index(stack) :]
    return [n for n in dict.fromkeys(later) if n in children and n != stack]


def kept_for_layers(base: nn.Module, stack: str) -> dict[str, str]:
    """What the base model keeps for its layers beside the hidden states (`kept_between_layers`);
    a ValueError naming what it keeps by a rule not read."""
    kept = kept_between_layers(type(base).forward, stack)
    unread = [name for name, join in kept.items() if join is None]
    if unread:
        raise ValueError(
            f"{type(base).__name__} cannot be cut into pipeline stages: its forward hands its layers "
            f"{unread} beside the hidden states, updated by a rule the blocks do not read"
        )
    return {name: join for name, join in kept.items() if join is not None}
