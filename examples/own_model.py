"""Train your own model through ``boost()``: one plan of roles, any composition of degrees.

    tessera run --nproc-per-node 2 --set parallel.tp=2 examples/own_model.py
    tessera run --nproc-per-node 4 --set parallel.dp=2 --set parallel.pp=2 examples/own_model.py
    tessera run --nproc-per-node 2 --set parallel.cp=2 examples/own_model.py --steps 20

The model below is plain PyTorch with its own names (``embed``, ``layers``, ``mix``,
``mlp``, ``lm_head``). ``boost`` reads the degrees from the configuration that ``tessera
run`` resolved; ``verify=True`` also runs the first step serially and refuses to train if the
parallel gradients differ from the serial ones.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.launcher import boost, load_config

VOCAB, SEQ = 64, 16


class Norm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Mix(nn.Module):
    """Causal self-attention. Tensor parallelism splits the projections by heads and sets
    ``heads`` to one rank's share, so the head width is a fixed attribute, not ``d // heads``."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (
            w(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for w in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.pre_mix, self.mix = Norm(d), Mix(d, heads)
        self.pre_mlp = Norm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.mix(self.pre_mix(x))
        return x + self.mlp(self.pre_mlp(x))


class MyModel(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, n_layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(n_layers))
        self.final = Norm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.final(h))


# What each module is; every tensor-parallel mode (1D, 2D, 2.5D, 3D) translates these roles.
ROLES = {
    "embed": "vocab",
    "layers.*.pre_mix": "norm",
    "layers.*.mix": "attention",
    "layers.*.mix.q": "colwise",
    "layers.*.mix.k": "colwise",
    "layers.*.mix.v": "colwise",
    "layers.*.mix.proj": "rowwise",
    "layers.*.pre_mlp": "norm",
    "layers.*.mlp": "region",
    "layers.*.mlp.0": "colwise",
    "layers.*.mlp.2": "rowwise",
    "final": "norm",
    "lm_head": "head",
}


def batch(step: int, size: int) -> tuple[Tensor, Tensor]:
    """A toy task every rank builds alike: continue a sequence that counts up by a fixed stride."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    args = parser.parse_args()

    config = load_config()  # what `tessera run` resolved and validated
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = MyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = boost(model, optimizer, config, plan=ROLES, verify=True)
    first = last = 0.0
    for step in range(args.steps):
        out = engine.train_step(*batch(step, args.batch))
        first, last = (out.loss if step == 0 else first), out.loss
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {out.loss:.4f}")
    if dist.get_rank() == 0:
        layout = config.parallel.topology().describe()
        print(f"loss {first:.4f} -> {last:.4f} in {args.steps} steps ({layout})")
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
