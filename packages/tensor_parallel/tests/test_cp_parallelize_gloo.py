"""Tier 2: ``context_parallelize`` on a user's model (not the reference GPT), and its errors.

The user model names its attention core ``mix`` and asks for full (non-causal) attention
through the core's ``causal`` attribute; it has no position embedding. Each rank's output
is compared with its slice of the serial output: fp32, rtol=1e-5, atol=1e-6 (outputs up to
~4 with the residual; attention merged over blocks by log-sum-exp differs by a few ulp,
measured <= 5e-7; attending causally or to the wrong block is off by ~0.1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.comm import CommMeter
from tessera.comm.testing.fixtures import PoolFactory
from tessera.models import GPT, GPTConfig
from tessera.tensor_parallel.context import (
    ContextParallelAttention,
    context_parallelize,
    split_batch,
    split_sequence,
)

HEADS, DIM = 2, 4


class FullAttention(nn.Module):
    causal = False

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v)


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HEADS * DIM, 3 * HEADS * DIM)
        self.mix = FullAttention()

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)
        return x + self.mix(q, k, v).transpose(1, 2).reshape(b, s, HEADS * DIM)  # type: ignore[no-any-return]


def _user_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Mixer(), Mixer())


def _user_run(rank: int, x: Tensor) -> tuple[Tensor, list[str]]:
    model = context_parallelize(_user_model(), None, layout="zigzag", cores="*.mix", positions=None)
    swapped = [repr(m) for m in model.modules() if isinstance(m, ContextParallelAttention)]
    (local,) = split_batch(x, group=None, layout="zigzag")
    return model(local).detach(), swapped


def test_a_user_model_with_a_named_core(worker_pools: PoolFactory) -> None:
    x = torch.randn(2, 16, HEADS * DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _user_model()(x)
    for rank, (got, swapped) in enumerate(worker_pools(2).run(_user_run, x)):
        assert swapped == ["ContextParallelAttention(mode=ring, layout=zigzag, causal=False)"] * 2
        torch.testing.assert_close(got, split_sequence(want, rank, 2, "zigzag"), rtol=1e-5, atol=1e-6)


def _errors(rank: int) -> list[str]:
    cases = [
        lambda: context_parallelize(GPT(GPTConfig()), None, cores="blocks.*.core"),
        lambda: context_parallelize(GPT(GPTConfig(dropout=0.1)), None),
        lambda: context_parallelize(GPT(GPTConfig(n_heads=2)), None, mode="ulysses", heads=3),
        lambda: context_parallelize(GPT(GPTConfig()), None, cores="layers.*.attn"),
    ]
    messages = []
    with CommMeter() as meter:
        for case in cases:
            try:
                case()
                messages.append("no error")
            except ValueError as e:
                messages.append(str(e))
    return [*messages, f"{meter.count()} calls"]


def test_errors_name_the_module_and_numbers(worker_pools: PoolFactory) -> None:
    for messages in worker_pools(2).run(_errors):
        assert messages == [
            "context_parallelize: pattern 'blocks.*.core' matches no module of GPT",
            "attention core layers.0.attn.core has dropout 0.1; context parallelism does not support it",
            "Ulysses attention needs heads=3 and kv heads=3 divisible by cp=2",
            "attention core layers.0.attn has parameters; only a parameter-free core can be swapped",
            "0 calls",
        ]
