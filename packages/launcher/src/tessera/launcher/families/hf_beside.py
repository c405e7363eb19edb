"""What a Hugging Face model hands its decoder layers from its inputs beside the hidden states,
made by the first pipeline stage and carried through the others in each stage's one activation
(`tessera.launcher.families.hf_streams.pack`), read from the layers' signatures, the model's
config and its attention modules:

- the token ids, where the layers take ``input_ids`` (DeepSeek-V4's hash-routed layers choose
  their experts by token id): int64 ``[batch, seq]``, carried as bytes (no gradient);
- per-layer inputs, where the layers take ``per_layer_input`` and the config has
  ``hidden_size_per_layer_input`` (Gemma 4, Gemma 3n): made by the first stage with the model's
  own ``get_per_layer_inputs`` and ``project_per_layer_inputs`` (from the token ids and the
  embeddings' output; the modules they use, ``embed_tokens_per_layer``,
  ``per_layer_model_projection`` and ``per_layer_projection_norm``, are held by the first block),
  all layers' ``[batch, seq, layers, width]`` carried as values with their gradient, each layer
  given its slice ``[:, :, i]``;
- keys and values one layer stores for later ones (Gemma's ``shared_kv_states``: an attention
  with ``store_full_length_kv`` writes ``shared_kv_states[self.layer_type]``, one with
  ``is_kv_shared_layer`` reads it): each layer given a dict holding what earlier stages carried,
  and what it stores carried on as values with their gradient, laid out by token (``[batch,
  seq, kv_heads, head_dim]``, the attention's ``[batch, kv_heads, seq, head_dim]`` transposed),
  for the layer types a later layer reads; none other travels. A family that shares them by
  another key (Kolibri 1.1's by layer index) is not read here: ``hf_layout.taken_beside`` refuses
  it where its config switches sharing on.

Importing this module does not import transformers.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from tessera.launcher.families.hf_layout import attentions_of
from tessera.launcher.families.hf_streams import applied_order

__all__ = ["Beside", "PerLayerInputs", "beside_of"]

_GET, _PROJECT = "get_per_layer_inputs", "project_per_layer_inputs"  # the model's own, by name
_STORED = "shared_kv_states[self.layer_type]"  # how a Gemma attention keys what it stores and reads


def _shares_by_layer_type(attention: nn.Module) -> bool:
    """Whether ``attention`` stores and reads shared keys and values as Gemma's does (by its
    ``layer_type``, switched by ``store_full_length_kv`` and ``is_kv_shared_layer``)."""
    if not all(hasattr(attention, a) for a in ("layer_type", "store_full_length_kv", "is_kv_shared_layer")):
        return False
    try:
        return _STORED in inspect.getsource(type(attention).forward)
    except (OSError, TypeError):
        return False


@dataclass(frozen=True, slots=True)
class Beside:
    """What travels beside the hidden states from the first stage (module docstring): the token
    ids (``ids``), the per-layer inputs (``per_layer``), a dict of shared keys and values handed
    to every layer (``shares_kv``) and, per layer index, the layer types whose keys and values a
    later layer reads (``kv_read_after``), carried under `names`."""

    ids: bool = False
    per_layer: bool = False
    shares_kv: bool = False
    kv_types: tuple[str, ...] = ()
    kv_read_after: tuple[frozenset[str], ...] = ()

    @property
    def handles(self) -> frozenset[str]:
        """The layers' arguments given here (``hf_layout.taken_beside`` refuses no other)."""
        taken = {"per_layer_input": self.per_layer, "shared_kv_states": self.shares_kv}
        return frozenset(n for n, yes in taken.items() if yes)

    def names(self) -> tuple[str, ...]:
        """The names of what is carried, in the order of the stage's activation."""
        kv = [f"shared_kv_states[{t}] {part}" for t in self.kv_types for part in ("keys", "values")]
        return (*(["input_ids"] if self.ids else []), *(["per_layer_inputs"] if self.per_layer else []), *kv)

    def start(self, ids: Tensor, per_layer_inputs: Tensor | None) -> list[tuple[str, Any]]:
        """What the first stage carries: the ids, the per-layer inputs, no keys or values yet."""
        values: list[Any] = [*([ids] if self.ids else []), *([per_layer_inputs] if self.per_layer else [])]
        return list(zip(self.names(), values + [None] * (len(self.names()) - len(values)), strict=True))

    def arguments(self, index: int, given: dict[str, Any]) -> dict[str, Any]:
        """Layer ``index``'s arguments from what was carried (``given``, by `names`)."""
        out: dict[str, Any] = {}
        if self.ids:
            out["input_ids"] = given["input_ids"]
        if self.per_layer:
            out["per_layer_input"] = given["per_layer_inputs"][:, :, index, :]
        if self.shares_kv:
            store: dict[str, tuple[Tensor, Tensor]] = {}
            for t in self.kv_types:
                keys, values = given[f"shared_kv_states[{t}] keys"], given[f"shared_kv_states[{t}] values"]
                if keys is not None and values is not None:
                    store[t] = (keys.transpose(1, 2), values.transpose(1, 2))
            out["shared_kv_states"] = store
        return out

    def handed(
        self, index: int, given: dict[str, Any], arguments: dict[str, Any], hidden: Tensor
    ) -> list[tuple[str, Any]]:
        """What layer ``index`` hands on: the ids and per-layer inputs it was given, and the keys
        and values stored so far (in ``arguments``' dict) that a later layer reads."""
        out: list[tuple[str, Any]] = [(n, given[n]) for n in ("input_ids", "per_layer_inputs") if n in given]
        store = arguments.get("shared_kv_states", {})
        for t in self.kv_types:
            kv = store.get(t) if t in self.kv_read_after[index] else None
            for part, value in zip(("keys", "values"), kv if kv is not None else (None, None), strict=True):
                out.append((f"shared_kv_states[{t}] {part}", _by_token(f"{t} {part}", value, hidden)))
        return out


def _by_token(name: str, value: Tensor | None, hidden: Tensor) -> Tensor | None:
    """Stored ``[batch, kv_heads, seq, head_dim]`` as ``[batch, seq, kv_heads, head_dim]``, which
    travels with its gradient only in the hidden states' dtype: another is refused, naming it."""
    if value is None:
        return None
    by_token = value.transpose(1, 2)
    if by_token.dtype != hidden.dtype or by_token.shape[:2] != hidden.shape[:2]:
        raise ValueError(
            f"the shared {name} ({value.dtype}, shape {tuple(value.shape)}) cannot be carried to the next "
            f"pipeline stage with their gradient: only in the hidden states' dtype {hidden.dtype} and "
            f"by token like them {list(hidden.shape[:2])}"
        )
    return by_token


def beside_of(base: nn.Module, layers: Sequence[nn.Module], config: Any) -> Beside:
    """What the layers of ``base`` take from its inputs that this module carries (a layer's
    signature is read from the first layer; shared keys and values from every attention)."""
    if not layers:
        return Beside()
    params = inspect.signature(layers[0].forward).parameters
    per_layer = (
        "per_layer_input" in params
        and bool(getattr(config, "hidden_size_per_layer_input", None))
        and all(callable(getattr(base, name, None)) for name in (_GET, _PROJECT))
    )
    attentions = [attentions_of(layer) for layer in layers]
    shares = "shared_kv_states" in params and all(
        len(a) == 1 and _shares_by_layer_type(a[0]) for a in attentions
    )
    if not shares:
        return Beside(ids="input_ids" in params, per_layer=per_layer)
    read = [str(a[0].layer_type) if a[0].is_kv_shared_layer else None for a in attentions]
    stored = [str(a[0].layer_type) for a in attentions if a[0].store_full_length_kv]
    types = tuple(dict.fromkeys(t for t in stored if t in read))
    after = tuple(frozenset(t for t in read[i + 1 :] if t is not None) for i in range(len(layers)))
    return Beside("input_ids" in params, per_layer, True, types, after)


class PerLayerInputs(nn.Module):
    """The per-layer inputs the model makes before its layers (module docstring), by its own
    ``get_per_layer_inputs`` and ``project_per_layer_inputs``; holds the modules they use that
    the embedding does not (``held``), so that their parameters are the first stage's."""

    def __init__(self, base: nn.Module, held: Sequence[nn.Module]) -> None:
        super().__init__()
        self.base = [base]  # the model's base: not a child (its layers are other stages')
        children = dict(base.named_children())
        used = [n for fn in (_GET, _PROJECT) for n in applied_order(getattr(type(base), fn))]
        mine = {id(m) for m in held}
        self.parts = nn.ModuleDict(
            {n: children[n] for n in dict.fromkeys(used) if n in children and id(children[n]) not in mine}
        )
        self.takes_embeds = len(inspect.signature(getattr(base, _GET)).parameters) > 1

    def forward(self, ids: Tensor, embeds: Tensor) -> Tensor:
        base: Any = self.base[0]
        identity = (
            base.get_per_layer_inputs(ids, embeds) if self.takes_embeds else base.get_per_layer_inputs(ids)
        )
        out: Tensor = base.project_per_layer_inputs(embeds, identity)
        return out
