"""A tiny decoder-only GPT in plain PyTorch: the serial model every package's tests compare to.

The model is a sequence of blocks, ``[embed, *layers, head]`` (see ``GPT.blocks()``), so the
pipeline partitioner can cut it; attention keeps q, k, v and output projections separate
and computes its head count from the projection width, so tensor parallelism can split
heads by slicing weights. Initialisation draws from a private generator seeded by the
caller: the same seed gives the same weights, whatever the global RNG state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "AttentionCore", "Block", "GPTConfig", "make_batch"]


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """Sizes of the reference GPT."""

    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads


class Embedding(nn.Module):
    """Token plus learned position embedding, then dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[-1], device=idx.device)
        out: Tensor = self.drop(self.tok(idx) + self.pos(positions))
        return out


class AttentionCore(nn.Module):
    """Scaled dot-product attention of (batch, heads, seq, head_dim) q, k, v: no parameters.

    A submodule of its own so that context parallelism can swap it for ring or Ulysses
    attention without touching the projections around it. ``causal`` and ``dropout`` say
    what the replacement must compute.
    """

    def __init__(self, *, causal: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.causal = causal
        self.dropout = dropout

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, dropout_p=self.dropout if self.training else 0.0
        )


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v and output projections."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(d, d, bias=cfg.bias)
        self.k_proj = nn.Linear(d, d, bias=cfg.bias)
        self.v_proj = nn.Linear(d, d, bias=cfg.bias)
        self.out_proj = nn.Linear(d, d, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.core = AttentionCore(causal=True, dropout=cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        heads = q.shape[-1] // self.head_dim  # fewer when the projections are split across ranks
        q, k, v = (t.view(b, s, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(b, s, heads * self.head_dim)
        out: Tensor = self.resid_drop(self.out_proj(y))
        return out


class MLP(nn.Module):
    """Two linear layers with GELU between."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias)
        self.fc_out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.drop(self.fc_out(F.gelu(self.fc_in(x))))
        return out


class Block(nn.Module):
    """A pre-norm transformer layer: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.lm_head(self.ln_f(x))
        return out


class GPT(nn.Module):
    """The reference decoder-only transformer: ``embed``, ``layers``, ``head``."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.head = Head(cfg)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 style init from a private generator: N(0, 0.02) weights, zero biases, unit norms."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    def blocks(self) -> list[nn.Module]:
        """The model as a sequence of blocks for pipelining: ``[embed, *layers, head]``."""
        return [self.embed, *self.layers, self.head]

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        out: Tensor = self.head(x)
        return out

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of the logits for ``idx`` against ``targets``."""
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def make_batch(cfg: GPTConfig, batch_size: int, *, seed: int) -> tuple[Tensor, Tensor]:
    """A deterministic random batch ``(idx, targets)`` of shape (batch_size, seq_len)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
