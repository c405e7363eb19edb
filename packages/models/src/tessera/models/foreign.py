"""Models written the way users write theirs, not shaped like the reference GPT.

Tests use them to hold every parallel mode to "equal to serial" on layouts Tessera's own
code never assumed. ``Llamaish``: RMSNorm (its weight called ``scale``), rotary positions
from a module inside each attention, a SwiGLU MLP (``w1``/``w2``/``w3``), grouped-query attention
(``wq``/``wk``/``wv``/``wo``, ``n_heads`` / ``n_kv_heads``) calling
``F.scaled_dot_product_attention`` inline, no biases, untied head. ``GPT2ish``: LayerNorm,
biases everywhere, learned positions, a GELU MLP (``fc``/``proj``), the LM head tied to the
token embedding. Both draw their weights from a private generator seeded by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT2ISH_ROLES", "LLAMAISH_ROLES", "ForeignConfig", "GPT2ish", "Llamaish", "Rotary"]

# The plans of roles a user writes for these models (``tessera.tensor_parallel``'s role names:
# every tensor-parallel mode turns them into its own layers). One home, so the suites and the
# benchmarks that train these models split them the same way.
LLAMAISH_ROLES: dict[str, str] = {
    "tok_embeddings": "vocab",
    "layers.*.attn_norm": "norm",
    "layers.*.attn": "attention",
    "layers.*.attn.wq": "colwise",
    "layers.*.attn.wk": "colwise",
    "layers.*.attn.wv": "colwise",
    "layers.*.attn.wo": "rowwise",
    "layers.*.ffn_norm": "norm",
    "layers.*.ffn": "region",
    "layers.*.ffn.w1": "colwise",
    "layers.*.ffn.w3": "colwise",
    "layers.*.ffn.w2": "rowwise",
    "norm": "norm",
    "output": "head",
}
GPT2ISH_ROLES: dict[str, str] = {  # LayerNorm, biases, fused q|k|v, learned positions, head tied to wte
    "wte": "vocab",
    "wpe": "embedding",
    "h.*.norm1": "norm",
    "h.*.mix": "attention",
    "h.*.mix.qkv": "colwise_qkv",
    "h.*.mix.proj": "rowwise",
    "h.*.norm2": "norm",
    "h.*.mlp": "region",
    "h.*.mlp.fc": "colwise",
    "h.*.mlp.proj": "rowwise",
    "ln": "norm",
    "head": "head",
}


@dataclass(frozen=True, slots=True)
class ForeignConfig:
    """Sizes of the foreign models (``kv_heads`` is Llamaish's; GPT2ish has heads only)."""

    vocab: int = 64
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    hidden: int = 96
    max_len: int = 64


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


class Rotary(nn.Module):
    """cos and sin of the rotary angles for the positions of ``x``'s sequence (dim 1): each
    (seq, head_dim)."""

    inv_freq: Tensor  # a buffer (registered in __init__)

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        t = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        angles = torch.outer(t, self.inv_freq)
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GQA(nn.Module):
    def __init__(self, c: ForeignConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.wq = nn.Linear(c.dim, c.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * self.head_dim, c.dim, bias=False)
        self.rope = Rotary(self.head_dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        cos, sin = self.rope(x)
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        return out


class SwiGLU(nn.Module):
    def __init__(self, c: ForeignConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class LlamaLayer(nn.Module):
    def __init__(self, c: ForeignConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(c.dim), GQA(c)
        self.ffn_norm, self.ffn = RMSNorm(c.dim), SwiGLU(c)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        out: Tensor = x + self.ffn(self.ffn_norm(x))
        return out


def _init(model: nn.Module, seed: int) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02, generator=gen)  # nonzero: a lost bias gradient shows
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


class Llamaish(nn.Module):
    """``tok_embeddings``, ``layers`` (attn_norm, attn with its ``rope``, ffn_norm, ffn), ``norm``,
    ``output``; its forward chains them (pipeline blocks are found without help)."""

    def __init__(self, c: ForeignConfig = ForeignConfig(), *, seed: int = 0) -> None:
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(LlamaLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)
        _init(self, seed)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        out: Tensor = self.output(self.norm(h))
        return out


class FusedAttention(nn.Module):
    def __init__(self, c: ForeignConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return out


class GeluMLP(nn.Module):
    def __init__(self, c: ForeignConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(c.dim, c.hidden)
        self.proj = nn.Linear(c.hidden, c.dim)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.proj(F.gelu(self.fc(x)))
        return out


class GPT2Layer(nn.Module):
    def __init__(self, c: ForeignConfig) -> None:
        super().__init__()
        self.norm1, self.mix = nn.LayerNorm(c.dim), FusedAttention(c)
        self.norm2, self.mlp = nn.LayerNorm(c.dim), GeluMLP(c)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.mix(self.norm1(x))
        out: Tensor = x + self.mlp(self.norm2(x))
        return out


class GPT2ish(nn.Module):
    """``wte``, ``wpe``, ``h`` (norm1, mix with fused ``qkv``, norm2, mlp), ``ln``, ``head``
    (tied to ``wte``)."""

    def __init__(self, c: ForeignConfig = ForeignConfig(), *, seed: int = 0) -> None:
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.dim)
        self.wpe = nn.Embedding(c.max_len, c.dim)
        self.h = nn.ModuleList(GPT2Layer(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self.head.weight = self.wte.weight
        _init(self, seed)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.wte(tokens) + self.wpe(positions)
        for layer in self.h:
            h = layer(h)
        out: Tensor = self.head(self.ln(h))
        return out
