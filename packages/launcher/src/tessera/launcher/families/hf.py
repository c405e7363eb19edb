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
  layer, whose indexer reads it; a dict of masks by kind where the model hands its layers one
  (ZAYA's ``{"causal": ..., "conv": ...}``: ``hf_layout.masks_by_key``);
- rotary embeddings: the model's ``rotary_emb`` called as its forward calls it (with the
  layer type where it takes one: Gemma3's local and global rotaries), or the layer's own
  where the model keeps one per base frequency (GraniteMoE-SWA's ``rotary_embs``); none for
  a layer type whose ``config.rope_parameters`` entry is None (Beam's and Ergo's full-attention
  layers, NoPE), whose attention then takes its family's position-dependent query scale where
  it has one (Beam's ``attention_scaling``, made by its modeling module's
  ``compute_attention_scaling``);
- positions: a row per sequence (Qwen4-Exp's indexer reads each row's rotary embeddings);
- what the layers carry between them (`tessera.launcher.families.hf_streams`): residual
  streams (hyper-connections: ``config.hc_count`` side by side, Qwen4-Exp; ``config.hc_mult``
  stacked, HunYuan-V4), which the modules after the layers mix back into one, applied in the
  order the forward applies them (given what they take of what was carried: Inkling 2's
  ``final_input``); what a layer returns that the forward hands to the next (HunYuan-V4's top-k
  indices by keyword, ZAYA's router state by position) and what the forward keeps for its layers
  beside the hidden states (Inkling 2's block states), carried in the stage's one activation
  beside the hidden states;
- what the layers take from the model's inputs (`tessera.launcher.families.hf_beside`), made by
  the first stage and carried in its activation: the token ids (DeepSeek-V4's hash layers), the
  per-layer inputs (Gemma 4's), the keys and values a layer stores for a later one (Gemma's
  ``shared_kv_states``); a layer kind its rotary module has none of is given them all by rope type
  (DeepSeek-V4's ``{"main", "compress"}``);
- the model's own parameters applied before the layers (ZAYA's input scale and bias:
  `tessera.launcher.families.hf_base_parameters`), held by the first block;
- Inkling 2's query-key distances (its modeling module's ``get_relative_distance``, by layer kind);
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

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from tessera.launcher.families import hf_layout as layout
from tessera.launcher.families.hf_base_parameters import BaseParameters, base_parameters
from tessera.launcher.families.hf_beside import Beside, PerLayerInputs, beside_of
from tessera.launcher.families.hf_streams import (
    Streams,
    apply_after,
    carried_between_layers,
    empty_stack,
    pack,
    stacked_on,
    streams_of,
    unpack,
)

__all__ = ["decoder_blocks", "gpt2_blocks", "llama_blocks", "opt_blocks"]


_HOOK = "_tessera_positions_hook"
_GUARD = "_tessera_own_forward_hooks"
_MADE = ("attention_mask", "position_ids", "position_embeddings", "relative_distance")  # made for a layer
_DISTANCE = "get_relative_distance"  # Inkling 2's query-key distances: (embeddings, cache, is_sliding)


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

    def __init__(
        self,
        norm: nn.Module,
        lm_head: nn.Module,
        config: Any = None,
        carried: tuple[str, ...] = (),
        beside: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.carried = carried  # what the layers carried beside the hidden states, by name (hf_streams)
        self.beside = beside  # what the first stage carried for the layers (hf_beside): dropped here
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.scale = getattr(config, "logit_scale", None)
        self.divide = getattr(config, "logits_scaling", None)
        self.width = getattr(config, "logits_mup_width_multiplier", None)

    def forward(self, h: Tensor) -> Tensor:
        if self.carried or self.beside:  # the modules after the layers, given what they take of it
            h, values = unpack(h)
            given = dict(zip((*self.carried, *self.beside), values, strict=True))
            given = {n: given[n] for n in self.carried}  # (Inkling 2's block states)
            for module in self.norm if isinstance(self.norm, nn.Sequential) else [self.norm]:
                h = apply_after(module, h, given)
        else:
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
    """The modules a model runs before its layers, chained, times its ``embedding_multiplier``, then
    its own parameters applied as its forward applies them (``own``, `hf_base_parameters`); copied
    into the residual streams the model's layers take (`Streams`), packed with nothing yet of what
    the layers hand on (``carries``), an empty stack of what the model keeps for them
    (``kept``, Inkling 2's block states; `hf_streams.pack`) and what the layers take from the
    model's inputs (``beside``: the token ids, the per-layer inputs ``per_layer`` makes;
    `hf_beside`)."""

    def __init__(
        self,
        modules: list[nn.Module],
        multiplier: float | None,
        streams: Streams | None = None,
        carries: tuple[str, ...] = (),
        kept: tuple[str, ...] = (),
        beside: Beside | None = None,
        per_layer: PerLayerInputs | None = None,
        own: BaseParameters | None = None,
    ) -> None:
        super().__init__()
        self.parts, self.own = nn.ModuleList(modules), own  # a child: the first stage trains its parameters
        self.multiplier = multiplier
        self.streams = streams
        self.carries, self.kept = carries, kept
        self.beside, self.per_layer = beside or Beside(), per_layer

    def forward(self, ids: Tensor) -> Tensor:
        h: Tensor = self.parts[0](ids)
        if self.multiplier is not None:
            h = h * self.multiplier
        for part in self.parts[1:]:
            h = part(h)
        h = h if self.own is None else self.own(h)
        beside = self.beside.start(ids, None if self.per_layer is None else self.per_layer(ids, h))
        if self.streams is not None:
            h = self.streams(h)
        if not self.carries and not self.kept and not beside:
            return h
        kept = [(n, empty_stack(h)) for n in self.kept]
        return pack(h, [*((n, None) for n in self.carries), *kept, *beside])


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

    def __init__(
        self,
        layer: nn.Module,
        index: int,
        rotary: nn.Module | None,
        config: Any,
        carried: dict[str, int] | None = None,
        kept: dict[str, str] | None = None,
        beside: Beside | None = None,
        masks: dict[str, str | None] | None = None,
    ) -> None:
        super().__init__()
        self.layer, self.config, self.index = layer, config, index
        self.masks = masks or {}  # a dict of masks by key -> kind (`hf_layout.masks_by_key`), or one mask
        self.beside = beside or Beside()  # what the first stage carries for the layers (hf_beside)
        self.carried = carried or {}  # keyword -> where in the layer's output (`carried_between_layers`)
        self.kept = kept or {}  # argument -> layer attribute: its input joins it (`kept_between_layers`)
        self.distance = layout.module_function(layer, _DISTANCE)
        self.kind = layout.layer_type(config, index)
        self.nope = layout.is_nope(config, self.kind)
        self.nope_scale = layout.nope_scale(layer) if self.nope else None
        self.rotary = [None if self.nope else rotary]  # a shared module, not a child
        takes = inspect.signature(rotary.forward).parameters if rotary is not None else {}
        self.rotary_takes_type = "layer_type" in takes
        types = getattr(rotary, "layer_types", None) if self.rotary_takes_type else None
        # a layer kind the rotary has none of: given them all by rope type (DeepSeek-V4's main, compress)
        self.rope_types = tuple(types) if isinstance(types, list | tuple) and self.kind not in types else ()
        signature = inspect.signature(layer.forward)
        refused = layout.taken_beside(signature, config, self.beside.handles)
        if refused:
            family = getattr(config, "model_type", None) or type(layer).__name__
            raise ValueError(
                f"{family} cannot be cut into pipeline stages: its layers ({type(layer).__name__}) take "
                f"{refused} beside the hidden states, and a stage receives the hidden states alone"
            )
        params = list(signature.parameters.values())[1:]
        # arguments the layer requires (Falcon's attention_mask, alibi): None here, made in the hook
        self.required = [p.name for p in params if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
        attentions = layout.attentions_of(layer)
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
            made["attention_mask"] = layout.mask_of(self.config, self.kind, self.masks, h, pos)
        if "position_ids" in names:
            made["position_ids"] = pos
        rotary = self.rotary[0]
        if rotary is not None and "position_embeddings" in names:
            rows = pos.expand(h.shape[0], -1)  # a row per sequence (Qwen4-Exp's indexer reads each row's)
            if self.rope_types:  # DeepSeek-V4's layers: each rope type's, by name
                made["position_embeddings"] = {t: rotary(h, rows, t) for t in self.rope_types}
            else:
                made["position_embeddings"] = (
                    rotary(h, rows, self.kind) if self.rotary_takes_type else rotary(h, rows)
                )
        if self.distance is not None and "relative_distance" in names:  # Inkling 2's, by layer kind
            made["relative_distance"] = self.distance(h, None, is_sliding="sliding" in self.kind)
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
        extra = self._made(
            h, _MADE if takes_ids else ("attention_mask", "position_embeddings", "relative_distance")
        )
        rest = {k: v for k, v in bound.items() if k != first}
        return (h,), {**rest, **extra}

    def forward(self, h: Tensor) -> Tensor:
        names = (*self.carried, *self.kept, *self.beside.names())
        given: dict[str, Any] = {}
        if names:
            h, values = unpack(h)
            given = dict(zip(names, values, strict=True))
        taken = {n: given[n] for n in (*self.carried, *self.kept)}
        beside = self.beside.arguments(self.index, given)
        made = self._made(h, self.direct)
        out = self.layer(h, **{**dict.fromkeys(self.required), **made, **taken, **beside})
        hidden: Tensor = out[0] if isinstance(out, tuple) else out
        if not names:
            return hidden
        kind = type(self.layer).__name__
        handed = [(f"{kind}'s output {i} ({k})", out[i]) for k, i in self.carried.items()]
        kept = [
            (k, stacked_on(given[k], h) if getattr(self.layer, a) else given[k]) for k, a in self.kept.items()
        ]
        return pack(hidden, [*handed, *kept, *self.beside.handed(self.index, given, beside, hidden)])


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """``[embedding, *layers, norm + lm_head]`` of a Hugging Face decoder-only model whose base
    model hands rotary embeddings and masks to its layers (see the module docstring)."""
    base = layout.base_of(model)
    config: Any = getattr(model, "config", None)
    layers = [n for n, m in base.named_children() if isinstance(m, nn.ModuleList) and not layout.is_rotary(m)]
    if len(layers) != 1:
        raise ValueError(f"{type(model).__name__}: expected one nn.ModuleList of layers, found {layers}")
    before, after = layout.order(base, layers[0])
    if not before or not after:
        raise ValueError(
            f"{type(model).__name__}: expected modules before its layers and a norm after them; pass "
            "ModelSpec(blocks=fn)"
        )
    stack: Any = base.get_submodule(layers[0])
    params = list(inspect.signature(stack[0].forward).parameters) if len(stack) else []
    carried = carried_between_layers(type(base).forward, layers[0], params)  # HunYuan-V4's, ZAYA's router's
    masks = layout.masks_by_key(type(base).forward, layers[0])  # ZAYA's {"causal": ..., "conv": ...}
    kept = layout.kept_for_layers(base, layers[0])  # Inkling 2's block states
    multiplier = layout.used(base, config, "embedding_multiplier")
    beside = beside_of(base, list(stack), config)  # token ids, per-layer inputs, shared keys and values
    per_layer = PerLayerInputs(base, before) if beside.per_layer else None
    own = base_parameters(base, layers[0])  # ZAYA's input_hidden_states_scale and _bias
    first = _Embedding(
        before, multiplier, streams_of(config), tuple(carried), tuple(kept), beside, per_layer, own
    )
    decoders = [
        _DecoderLayer(layer, i, layout.rotary_of(base, config, i), config, carried, kept, beside, masks)
        for i, layer in enumerate(stack)
    ]
    blocks: list[nn.Module] = [first]
    blocks += _guarded(model, decoders)
    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module):
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head)")
    norm = after[0] if len(after) == 1 else nn.Sequential(*after)  # HunYuan-V4's hc_head, then norm
    return [*blocks, _Head(norm, head, config, carried=(*carried, *kept), beside=beside.names())]


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
