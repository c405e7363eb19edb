"""The model and data of ``bench lora``: a Llama-shaped Hugging Face ``LlamaForCausalLM`` built
from its config in bf16 (random weights, nothing downloaded), wrapped by PEFT's LoRA or not, and
the batches every system trains on. It needs torch, transformers and peft only, so the Tessera
ranks, the torch + peft process and DeepSpeed's own Python all import it.

- ``LoraSize``: the shape (default d=768, 12 layers, 12 heads over 4 KV heads, SwiGLU width
  2048, vocabulary 32,000, untied head: 124.7M parameters, a GPT-2-small-sized Llama) and the
  adapters (rank 16, alpha 32, no dropout, on every linear layer of the blocks: q, k, v, o,
  gate, up, down: 2.6M trainable parameters).
- ``build``: the base built by ``AutoModelForCausalLM.from_config(..., dtype=bfloat16)`` under a
  fixed seed (what ``from_pretrained(..., dtype=bfloat16)`` leaves in memory: the whole model in
  bf16), then ``peft.get_peft_model`` (which keeps the adapters in fp32 over a bf16 base:
  ``autocast_adapter_dtype``); without LoRA every parameter trains.
- ``batch``: step ``k``'s global batch, ``rows`` sequences of ``seq`` uniform random tokens
  and their next tokens, from a generator seeded by ``k``: every system and rank draws the same.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class LoraSize:
    """The model's shape, the adapters' settings and the global batch of one step."""

    vocab: int = 32000
    dim: int = 768
    layers: int = 12
    heads: int = 12
    kv_heads: int = 4
    ffn: int = 2048
    rank: int = 16
    alpha: int = 32
    seq: int = 128
    rows: int = 4
    targets: tuple[str, ...] = field(default=TARGETS)

    def label(self) -> str:
        return (
            f"hf-llama d={self.dim} L={self.layers} ffn={self.ffn} V={self.vocab} "
            f"h={self.heads}/{self.kv_heads} bf16 batch={self.rows}x{self.seq}"
        )

    def lora_label(self) -> str:
        return f"lora r={self.rank} alpha={self.alpha} on {','.join(self.targets)}"


def hf_config(size: LoraSize) -> Any:
    """The ``transformers.LlamaConfig`` of ``size`` (no dropout, no tied head)."""
    transformers: Any = importlib.import_module("transformers")
    return transformers.LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.dim,
        intermediate_size=size.ffn,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=max(512, size.seq),
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def build(size: LoraSize, *, lora: bool, seed: int = 0) -> nn.Module:
    """The bf16 base of ``size`` (seeded), wrapped by PEFT's LoRA when ``lora`` (see the module doc)."""
    transformers: Any = importlib.import_module("transformers")
    torch.manual_seed(seed)
    model: nn.Module = transformers.AutoModelForCausalLM.from_config(hf_config(size), dtype=torch.bfloat16)
    if not lora:
        return model
    peft: Any = importlib.import_module("peft")
    config = peft.LoraConfig(
        r=size.rank,
        lora_alpha=size.alpha,
        lora_dropout=0.0,
        target_modules=list(size.targets),
    )
    wrapped: nn.Module = peft.get_peft_model(model, config)
    return wrapped


def trainable(model: nn.Module) -> int:
    """Elements of the parameters that train (DeepSpeed's partitioned ones by ``ds_numel``)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)


def total(model: nn.Module) -> int:
    """Elements of every parameter (DeepSpeed's partitioned ones by ``ds_numel``)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


def batch(size: LoraSize, step: int) -> tuple[Tensor, Tensor]:
    """Step ``step``'s global batch: ids and next-token targets, each (rows, seq)."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, size.vocab, (size.rows, size.seq + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def logits(output: object) -> Tensor:
    """A Hugging Face output's ``.logits`` (or the output itself)."""
    out = getattr(output, "logits", output)
    assert isinstance(out, Tensor)
    return out
