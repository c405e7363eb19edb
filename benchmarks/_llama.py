"""A Llama-style causal LM in plain torch: the model of ``bench big-model``, written the way a
user writes one, and importable by every system's child (Tessera's, FSDP2's and DeepSpeed's
own virtual environment: it needs only torch).

Hugging Face's parameter names (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``,
``...mlp.gate_proj``, ``...input_layernorm``, ``model.norm``, ``lm_head``), grouped-query
attention with rotary positions computed in the forward (no buffers: a model built on the
meta device and then given storage has nothing left uninitialized), a SwiGLU MLP, no biases,
an untied head. Every module that owns parameters has ``reset_parameters``, so deferred
initialization (Tessera's ``deferred_parameters``, FSDP2's meta device + ``to_empty``) needs
no help. ``checkpoint_value`` gives the values ``bench big-model`` writes to its checkpoint,
one tensor at a time, from the name alone.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class LlamaSize:
    """The shape of the model; ``hidden`` of 0 means Llama's rule: 8/3 of ``dim`` rounded up
    to a multiple of 256 (5632 at 2048)."""

    vocab: int = 32000
    dim: int = 2048
    layers: int = 20
    heads: int = 16
    kv_heads: int = 4
    hidden: int = 0

    @property
    def ffn(self) -> int:
        return self.hidden or -(-8 * self.dim // 3 // 256) * 256

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter's name and shape, in the model's order."""
        d, kv = self.dim, self.dim // self.heads * self.kv_heads
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, d))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                (p + "input_layernorm.weight", (d,)),
                (p + "self_attn.q_proj.weight", (d, d)),
                (p + "self_attn.k_proj.weight", (kv, d)),
                (p + "self_attn.v_proj.weight", (kv, d)),
                (p + "self_attn.o_proj.weight", (d, d)),
                (p + "post_attention_layernorm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (self.ffn, d)),
                (p + "mlp.up_proj.weight", (self.ffn, d)),
                (p + "mlp.down_proj.weight", (d, self.ffn)),
            ]
        return [*out, ("model.norm.weight", (d,)), ("lm_head.weight", (self.vocab, d))]

    def params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.shapes())

    def label(self) -> str:
        return (
            f"llama d={self.dim} L={self.layers} ffn={self.ffn} V={self.vocab} h={self.heads}/{self.kv_heads}"
        )


def checkpoint_value(name: str, shape: tuple[int, ...], seed: int = 0) -> Tensor:
    """The value of ``name`` in the bench's checkpoint: norms' gains 1, every matrix drawn from
    N(0, 0.02) by a generator seeded by ``seed`` and the name."""
    if len(shape) == 1:
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen).mul_(0.02)


def fixed_batch(size: LlamaSize, batch: int, seq: int, rank: int) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s batch of every step (the same for every system): ``batch`` sequences of
    ``seq`` tokens and their next tokens, seeded by the rank."""
    gen = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, size.vocab, (batch, seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotary(x: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles for the positions of ``x`` (batch, heads, seq, head_dim)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=x.device) / head_dim))
    angles = torch.outer(torch.arange(x.shape[2], dtype=torch.float32, device=x.device), inv)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, s: LlamaSize) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.dim // s.heads
        self.q_proj = nn.Linear(s.dim, s.dim, bias=False)
        self.k_proj = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(s.dim, s.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = _rotary(q, self.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out: Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        return out


class MLP(nn.Module):
    def __init__(self, s: LlamaSize) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.dim, s.ffn, bias=False)
        self.up_proj = nn.Linear(s.dim, s.ffn, bias=False)
        self.down_proj = nn.Linear(s.ffn, s.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Block(nn.Module):
    def __init__(self, s: LlamaSize) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(s.dim), Attention(s)
        self.post_attention_layernorm, self.mlp = RMSNorm(s.dim), MLP(s)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Trunk(nn.Module):
    def __init__(self, s: LlamaSize) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.dim)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.dim)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h)
        out: Tensor = self.norm(h)
        return out


class LlamaLM(nn.Module):
    """``model`` (the trunk) and ``lm_head``; ``forward(tokens)`` returns the logits."""

    def __init__(self, s: LlamaSize) -> None:
        super().__init__()
        self.model = Trunk(s)
        self.lm_head = nn.Linear(s.dim, s.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        out: Tensor = self.lm_head(self.model(tokens))
        return out

    def blocks(self) -> list[nn.Module]:
        return list(self.model.layers)
