"""Pipeline blocks of Hugging Face ``GPT2LMHeadModel`` and ``LlamaForCausalLM``.

Their forwards do more than chain their children: GPT-2 adds position embeddings to the
token embeddings, Llama computes rotary embeddings and a causal mask once and hands them to
every decoder layer. A pipeline stage receives only the hidden states, so each block here
recomputes what its layer needs from the sequence it sees (positions ``0..seq-1``: training
from the start of each sequence, no cache; Llama's from the sequence its attention sees,
whole under sequence parallelism). The blocks hold the model's own submodules, so
parameter names and values stay the model's. Importing this module does not import
transformers; building the Llama blocks does.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["gpt2_blocks", "llama_blocks"]


_HOOK = "_tessera_positions_hook"


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
    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, h: Tensor) -> Tensor:
        out: Tensor = self.lm_head(self.norm(h))
        return out


def gpt2_blocks(model: nn.Module) -> list[nn.Module]:
    """``[embedding, *h, ln_f + lm_head]`` of a ``GPT2LMHeadModel``."""
    t: Any = model.transformer
    head = _Head(t.ln_f, model.get_submodule("lm_head"))
    return [_GPT2Embedding(t), *(_Layer(block) for block in t.h), head]


class _LlamaLayer(nn.Module):
    """A Llama decoder layer with the rotary embeddings and causal mask of the sequence its
    attention sees: computed in a pre-hook of ``self_attn`` from the hidden states it is
    called with, which under sequence parallelism are the whole sequence (the layer's input,
    a stage's activation, holds this rank's slice of it)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config: Any) -> None:
        super().__init__()
        self.layer, self.rotary, self.config = layer, rotary, config
        attention: Any = layer.self_attn
        old = getattr(attention, _HOOK, None)
        if old is not None:  # blocks built again (after tensor parallelism): this hook runs last
            old.remove()
        hook = attention.register_forward_pre_hook(self._positions_of_attention, with_kwargs=True)
        setattr(attention, _HOOK, hook)

    def _positions_of_attention(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # an optional dependency, reached untyped (mypy may run without it)
        create_causal_mask = importlib.import_module("transformers.masking_utils").create_causal_mask

        h = args[0] if args else kwargs["hidden_states"]
        pos = _positions(h)
        mask = create_causal_mask(self.config, h, None, None, position_ids=pos)
        extra = {"attention_mask": mask, "position_ids": pos, "position_embeddings": self.rotary(h, pos)}
        return args, {**kwargs, **extra}

    def forward(self, h: Tensor) -> Tensor:
        out = self.layer(h)
        hidden: Tensor = out[0] if isinstance(out, tuple) else out
        return hidden


def llama_blocks(model: nn.Module) -> list[nn.Module]:
    """``[embed_tokens, *layers, norm + lm_head]`` of a ``LlamaForCausalLM``."""
    inner: Any = model.model
    layers = [_LlamaLayer(layer, inner.rotary_emb, inner.config) for layer in inner.layers]
    return [inner.embed_tokens, *layers, _Head(inner.norm, model.get_submodule("lm_head"))]
