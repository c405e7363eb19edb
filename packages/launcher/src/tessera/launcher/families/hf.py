"""Pipeline blocks of Hugging Face decoder-only language models.

Their forwards do more than chain their children: GPT-2 adds position embeddings to the
token embeddings; the rotary families (Llama, Mistral, Qwen, Gemma, Phi, GPT-NeoX, GPT-J,
StarCoder2, OLMo, Cohere, Granite, StableLM, Falcon, ...) compute rotary embeddings and
their attention masks once and hand them to every decoder layer, some scale the embedding
(Granite's ``embedding_multiplier``) or the logits (Gemma's soft cap, Cohere's
``logit_scale``, Granite's ``logits_scaling``). A pipeline stage receives only the hidden
states, so each block here recomputes what its layer needs from the sequence it sees
(positions ``0..seq-1``: training from the start of each sequence, no cache) and applies
what the model's forward applies around its children:

- masks: each layer's own kind, as the model builds it: ``config.layer_types[i]``, else a
  sliding window wherever ``config.sliding_window`` is set (Mistral, Phi3, StarCoder2); built
  by the function ``transformers`` keeps for that kind (``masking_utils``' table of layer
  kinds): a causal or sliding-window mask, so a window is kept; the padding mask of a Mamba
  or linear-attention layer (None: no padding); the whole causal mask of an indexed (DSA)
  layer, whose indexer reads it;
- rotary embeddings: the model's ``rotary_emb`` called as its forward calls it (with the
  layer type where it takes one: Gemma3's local and global rotaries), or the layer's own
  where the model keeps one per base frequency (GraniteMoE-SWA's ``rotary_embs``); none for
  a layer type whose ``config.rope_parameters`` entry is None (Beam's and Ergo's full-attention
  layers, NoPE), whose attention then takes its family's position-dependent query scale where
  it has one (Beam's ``attention_scaling``, made by its modeling module's
  ``compute_attention_scaling``);
- positions: a row per sequence (Qwen4-Exp's indexer reads each row's rotary embeddings);
- hyper-connections: the embedding's output copied into ``config.hc_count`` residual streams
  side by side (Qwen4-Exp's), which the module after the layers mixes back into one;
- computed in a pre-hook of the layer's attention module from the hidden states it is
  called with, which under sequence parallelism are the whole sequence (the layer's input,
  a stage's activation, holds this rank's slice of it); a layer without an attention module
  (a hybrid's Mamba or gated delta net layer) is given the mask of its kind by its block, from
  its input (its recurrent mixer reads no positions).

The blocks hold the model's own submodules, so parameter names and values stay the model's.
``boost()`` checks that the blocks reproduce the model's logits before partitioning (with
the user's example batch, else random token ids); the hooks stand aside while the model's own
forward runs, so that check holds the blocks to what ``transformers`` computes. A family whose
layers take more than one activation (Zamba's embeddings' output) is refused. Importing this
module does not import transformers; building the blocks of a rotary family does.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["decoder_blocks", "gpt2_blocks", "llama_blocks", "opt_blocks"]


_HOOK = "_tessera_positions_hook"
_GUARD = "_tessera_own_forward_hooks"
_MADE = ("attention_mask", "position_ids", "position_embeddings")  # what a block makes for a layer
_NOPE_SCALE = "compute_attention_scaling"  # Beam's query scale of its NoPE layers, from the positions


def _positions(h: Tensor) -> Tensor:
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)


class _GPT2Embedding(nn.Module):
    def __init__(self, transformer: Any) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, ids: Tensor) -> Tensor:
        out: Tensor = self.drop(self.wte(ids) + self.wpe(_positions(ids)))
        return out


class _Layer(nn.Module):
    """A decoder layer called on hidden states alone (GPT-2: its own causal mask)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, h: Tensor) -> Tensor:
        out = self.layer(h)
        hidden: Tensor = out[0] if isinstance(out, tuple) else out
        return hidden


class _Head(nn.Module):
    """The final norm and LM head, with the logit transforms of the model's forward (read
    from its config: ``final_logit_softcapping``, ``logit_scale``, ``logits_scaling``, and
    Inkling's ``logits_mup_width_multiplier`` dividing the hidden states before the head)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, config: Any = None) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.scale = getattr(config, "logit_scale", None)
        self.divide = getattr(config, "logits_scaling", None)
        self.width = getattr(config, "logits_mup_width_multiplier", None)

    def forward(self, h: Tensor) -> Tensor:
        h = self.norm(h)
        out: Tensor = self.lm_head(h if self.width is None else h / self.width)
        if self.scale is not None:
            out = out * self.scale
        if self.divide is not None:
            out = out / self.divide
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out


def gpt2_blocks(model: nn.Module) -> list[nn.Module]:
    """``[embedding, *h, ln_f + lm_head]`` of a ``GPT2LMHeadModel``."""
    t: Any = model.transformer
    head = _Head(t.ln_f, model.get_submodule("lm_head"))
    return [_GPT2Embedding(t), *(_Layer(block) for block in t.h), head]


class _Embedding(nn.Module):
    """The modules a model runs before its layers, chained, times its ``embedding_multiplier``;
    copied into ``streams`` residual streams side by side where the model's layers take that many
    (Qwen4-Exp's hyper-connections, ``config.hc_count``: ``h.repeat(1, 1, hc_count)``)."""

    def __init__(
        self, modules: list[nn.Module], multiplier: float | None, streams: int | None = None
    ) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)
        self.multiplier = multiplier
        self.streams = streams

    def forward(self, ids: Tensor) -> Tensor:
        h: Tensor = self.parts[0](ids)
        if self.multiplier is not None:
            h = h * self.multiplier
        for part in self.parts[1:]:
            h = part(h)
        if self.streams is not None:
            h = h.repeat(1, 1, self.streams)
        return h


def _layer_type(config: Any, index: int) -> str:
    types = getattr(config, "layer_types", None)
    if types:
        return str(types[index])
    window = getattr(config, "sliding_window", None)
    return "sliding_attention" if window and getattr(config, "use_sliding_window", True) else "full_attention"


def _mask_function(kind: str) -> Any:
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


_ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")


def _attentions_of(layer: nn.Module) -> list[nn.Module]:
    """The layer's attention modules: a child whose class name says Attention, or the members of
    a ModuleList child that are or that is named so (LongCat-Flash's two ``self_attn`` per
    layer); none for a layer whose mixer is another (Mamba, gated delta net, short convolution)."""
    for name, sub in layer.named_children():
        if "attention" in type(sub).__name__.lower():
            return [sub]
        members = list(sub) if isinstance(sub, nn.ModuleList) else []
        named = name in _ATTENTION_NAMES or all("attention" in type(m).__name__.lower() for m in members)
        if members and named:
            return members
    return []


def _rotary_of(base: nn.Module, config: Any, index: int) -> nn.Module | None:
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
        named = [m for m in base.children() if _is_rotary(m) and not isinstance(m, nn.ModuleList)]
        return named[0] if len(named) == 1 else None  # under another name (LFM2's pos_emb)
    theta = thetas[index]
    if not theta:
        return None
    for rotary in rotaries:
        parameters = getattr(getattr(rotary, "config", None), "rope_parameters", None) or {}
        if parameters.get("rope_theta") == theta:
            return rotary
    raise ValueError(f"{type(base).__name__} has no rotary module of base {theta} for layer {index}")


class _OwnForward:
    """How many calls of the model's own forward are running: the blocks' attention hooks
    stand aside in them, so ``model(ids)`` computes what ``transformers`` computes (what
    ``boost()`` checks the blocks against), not what the blocks compute."""

    def __init__(self) -> None:
        self.depth = 0

    def enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.depth += 1

    def leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.depth -= 1


def _guarded(model: nn.Module, layers: list[_DecoderLayer]) -> list[_DecoderLayer]:
    """``layers``, whose hooks stand aside while ``model``'s own forward runs (`_OwnForward`);
    the hooks of blocks built before are removed."""
    for old in getattr(model, _GUARD, ()):
        old.remove()
    own = _OwnForward()
    handles = (
        model.register_forward_pre_hook(own.enter),
        model.register_forward_hook(own.leave, always_call=True),
    )
    setattr(model, _GUARD, handles)
    for layer in layers:
        layer.own = own
    return layers


class _DecoderLayer(nn.Module):
    """A decoder layer called on hidden states alone: its attention's mask, position ids and
    rotary embeddings made in a pre-hook of the attention module from the hidden states it
    sees; a layer of another mixer (Mamba, gated delta net) given the mask of its kind, made
    from its input (see the module docstring)."""

    def __init__(self, layer: nn.Module, index: int, rotary: nn.Module | None, config: Any) -> None:
        super().__init__()
        self.layer, self.config = layer, config
        self.kind = _layer_type(config, index)
        self.nope = _is_nope(config, self.kind)
        self.nope_scale = _nope_scale(layer) if self.nope else None
        self.rotary = [None if self.nope else rotary]  # a shared module, not a child
        takes = inspect.signature(rotary.forward).parameters if rotary is not None else {}
        self.rotary_takes_type = "layer_type" in takes
        signature = inspect.signature(layer.forward)
        carried = _carried(signature, config)
        if carried:
            family = getattr(config, "model_type", None) or type(layer).__name__
            raise ValueError(
                f"{family} cannot be cut into pipeline stages: its layers ({type(layer).__name__}) take "
                f"{carried} beside the hidden states, and a stage receives the hidden states alone"
            )
        params = list(signature.parameters.values())[1:]
        # arguments the layer requires (Falcon's attention_mask, alibi): None here, made in the hook
        self.required = [p.name for p in params if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
        attentions = _attentions_of(layer)
        self.direct: tuple[str, ...] = ()  # the arguments made for the layer itself (no attention)
        self.own: _OwnForward | None = None  # set by `_guarded`
        if not attentions:  # a recurrent mixer reads its kind's mask (None: nothing padded), no positions
            self.direct = ("attention_mask",) if "attention_mask" in signature.parameters else ()
            return
        self.signatures = {id(a): inspect.signature(a.forward) for a in attentions}
        for attention in attentions:
            old = getattr(attention, _HOOK, None)
            if old is not None:  # blocks built again (after tensor parallelism): this hook runs last
                old.remove()
            hook = attention.register_forward_pre_hook(self._arguments_of_attention, with_kwargs=True)
            setattr(attention, _HOOK, hook)

    def _made(self, h: Tensor, names: tuple[str, ...]) -> dict[str, Any]:
        """Those of `_MADE` in ``names``, for hidden states ``h`` (the whole sequence)."""
        pos = _positions(h)
        made: dict[str, Any] = {}
        if "attention_mask" in names:
            made["attention_mask"] = _mask_function(self.kind)(self.config, h, None, None, position_ids=pos)
        if "position_ids" in names:
            made["position_ids"] = pos
        rotary = self.rotary[0]
        if rotary is not None and "position_embeddings" in names:
            rows = pos.expand(h.shape[0], -1)  # a row per sequence (Qwen4-Exp's indexer reads each row's)
            made["position_embeddings"] = (
                rotary(h, rows, self.kind) if self.rotary_takes_type else rotary(h, rows)
            )
        if self.nope and "position_embeddings" in names:  # NoPE: no rotary, Beam's query scale
            made["position_embeddings"] = None
            if self.nope_scale is not None:
                made["attention_scaling"] = self.nope_scale(pos)
        return made

    def _arguments_of_attention(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self.own is not None and self.own.depth:  # the model's own forward: its arguments stand
            return None
        signature = self.signatures[id(module)]
        bound = signature.bind_partial(*args, **kwargs).arguments
        first = next(iter(signature.parameters))
        h = bound[first]
        takes_ids = "position_ids" in signature.parameters or "kwargs" in signature.parameters
        extra = self._made(h, _MADE if takes_ids else ("attention_mask", "position_embeddings"))
        rest = {k: v for k, v in bound.items() if k != first}
        return (h,), {**rest, **extra}

    def forward(self, h: Tensor) -> Tensor:
        out = self.layer(h, **{**dict.fromkeys(self.required), **self._made(h, self.direct)})
        hidden: Tensor = out[0] if isinstance(out, tuple) else out
        return hidden


# what a family's layers take beside the hidden states, made before the layers or by the layer
# before: none of it reaches a pipeline stage
_CARRIED = {
    "original_hidden_states": "the embeddings' output (original_hidden_states)",
    "per_layer_input": "per-layer embeddings of the token ids (per_layer_input)",
    "shared_kv_states": "keys and values of earlier layers (shared_kv_states)",
}
# those a family's layers take only when its config switches them on (Gemma's)
_SWITCHED = {"per_layer_input": "hidden_size_per_layer_input", "shared_kv_states": "num_kv_shared_layers"}


def _carried(signature: inspect.Signature, config: Any) -> str:
    """What of `_CARRIED` a layer of this signature is given by its model (Zamba's embeddings'
    output, Gemma 4's per-layer embeddings where its config has them), as words; "" when nothing."""
    names = [
        n
        for n in _CARRIED
        if n in signature.parameters and (n not in _SWITCHED or bool(getattr(config, _SWITCHED[n], None)))
    ]
    return " and ".join(_CARRIED[n] for n in names)


def _is_nope(config: Any, kind: str) -> bool:
    """Whether layers of ``kind`` take no rotary embeddings (``config.rope_parameters[kind]`` is
    None: Beam's and Ergo's full-attention layers)."""
    per_type = getattr(config, "rope_parameters", None)
    return isinstance(per_type, dict) and kind in per_type and per_type[kind] is None


def _nope_scale(layer: nn.Module) -> Any:
    """The query scale a NoPE layer's attention takes (``attention_scaling``), where its family's
    modeling module has one (Beam's ``compute_attention_scaling``: positions -> scale); else
    None: the layer is given ``position_embeddings=None`` alone, as Ergo's model gives it (a
    family doing otherwise fails ``check_blocks`` before anything is partitioned)."""
    scale = getattr(importlib.import_module(type(layer).__module__), _NOPE_SCALE, None)
    return scale if callable(scale) else None


def _used(base: nn.Module, config: Any, name: str) -> Any:
    """``config.<name>`` where the base model's forward reads it (Granite's ``embedding_multiplier``),
    else None (Inkling's config holds one that its forward does not apply)."""
    value = getattr(config, name, None)
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return value
    return value if name in source else None


def _base(model: nn.Module) -> nn.Module:
    """The base model under the head: the child ``base_model_prefix`` names, else ``model`` (Llama
    4's text model names its prefix ``language_model`` and keeps its base as ``model``)."""
    prefix = getattr(model, "base_model_prefix", "")
    for name in (prefix, "model"):
        base = getattr(model, name, None) if name else None
        if isinstance(base, nn.Module):
            return base
    return model


def _is_rotary(module: nn.Module) -> bool:
    """A rotary module, or a list of them (GraniteMoE-SWA's ``rotary_embs``, one per base frequency)."""
    if isinstance(module, nn.ModuleList):
        return len(module) > 0 and all(_is_rotary(m) for m in module)
    return "rotary" in type(module).__name__.lower()


def _order(base: nn.Module, stack: str) -> tuple[list[nn.Module], list[nn.Module]]:
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
        return [base.get_submodule(n) for n in part if not _is_rotary(base.get_submodule(n))]

    return modules(names[:at]), modules(names[at + 1 :])


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """``[embedding, *layers, norm + lm_head]`` of a Hugging Face decoder-only model whose base
    model hands rotary embeddings and masks to its layers (see the module docstring)."""
    base = _base(model)
    config: Any = getattr(model, "config", None)
    layers = [n for n, m in base.named_children() if isinstance(m, nn.ModuleList) and not _is_rotary(m)]
    if len(layers) != 1:
        raise ValueError(f"{type(model).__name__}: expected one nn.ModuleList of layers, found {layers}")
    before, after = _order(base, layers[0])
    if not before or len(after) != 1:
        raise ValueError(
            f"{type(model).__name__}: expected modules before its layers and one norm after them; pass "
            "ModelSpec(blocks=fn)"
        )
    stack: Any = base.get_submodule(layers[0])
    streams = getattr(config, "hc_count", None)  # hyper-connected residual streams, mixed into one after
    embedding = _Embedding(before, _used(base, config, "embedding_multiplier"), streams)
    blocks: list[nn.Module] = [embedding]
    decoders = [_DecoderLayer(layer, i, _rotary_of(base, config, i), config) for i, layer in enumerate(stack)]
    blocks += _guarded(model, decoders)
    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module):
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head)")
    return [*blocks, _Head(after[0], head, config)]


class _OPTEmbedding(nn.Module):
    """OPT's decoder before its layers: tokens (projected in), plus learned positions."""

    def __init__(self, decoder: Any) -> None:
        super().__init__()
        self.tokens, self.positions, self.project_in = (
            decoder.embed_tokens,
            decoder.embed_positions,
            decoder.project_in,
        )

    def forward(self, ids: Tensor) -> Tensor:
        h: Tensor = self.tokens(ids)
        if self.project_in is not None:
            h = self.project_in(h)
        positions: Tensor = self.positions(None, 0, position_ids=_positions(ids))
        return h + positions


def opt_blocks(model: nn.Module) -> list[nn.Module]:
    """``[embedding + positions, *layers, final norm (+ project out) + lm_head]`` of an
    ``OPTForCausalLM``; each layer's causal mask made in its attention's pre-hook."""
    decoder: Any = model.get_submodule("model.decoder")
    config: Any = getattr(model, "config", None)
    layers = _guarded(
        model, [_DecoderLayer(layer, i, None, config) for i, layer in enumerate(decoder.layers)]
    )
    after = [m for m in (decoder.final_layer_norm, decoder.project_out) if m is not None]
    norm = after[0] if len(after) == 1 else nn.Sequential(*after)
    return [_OPTEmbedding(decoder), *layers, _Head(norm, model.get_submodule("lm_head"), config)]


llama_blocks = decoder_blocks  # Llama's layout is the rotary families' own
