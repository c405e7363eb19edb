"""Tier 1 (threaded ranks): an attention module whose shards would not add up is refused, and
so is a region that is not an MLP (a norm and a gate beside its dense layers).

``parallelize`` divides an attention module's head-count attributes by tp. A module that
derives its head width from that count and its input (``x.shape[-1] // self.heads``, a
common way to write it) then computes something else on every rank, silently. The probe
(``tessera.tensor_parallel.probe``) runs each rank's share of one module per class locally
and refuses before anything is converted; the same module written with a fixed head width
passes and its parallel output equals the serial one (fp32 round-off: rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm import Mesh, Topology
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel import parallelize


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, *, width_from_input: bool, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.width_from_input = width_from_input
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(d, d, bias=True)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        width = d // self.heads if self.width_from_input else self.head_dim
        q = self.q(x).view(b, t, -1, width).transpose(1, 2)
        k, v = (w(x).view(b, t, -1, width).transpose(1, 2) for w in (self.k, self.v))
        k, v = (z.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Net(nn.Module):
    def __init__(self, attention: Attention) -> None:
        super().__init__()
        self.mixer = attention


PLAN = {
    "mixer": "attention",
    "mixer.q": "colwise",
    "mixer.k": "colwise",
    "mixer.v": "colwise",
    "mixer.o": "rowwise",
}


def _parallel(rank: int, net: Net, tp: int, x: Tensor) -> Tensor:
    mesh = Mesh(Topology(tp=tp))
    model = parallelize(copy.deepcopy(net), plan=PLAN, mesh=mesh)
    return model.mixer(x)


def test_a_head_width_taken_from_the_input_is_refused_before_anything_changes() -> None:
    net = Net(Attention(16, 4, 4, width_from_input=True, seed=1))
    refusal = r"mixer \(attention\): split over tp=2, the shards of Attention do not add up"
    with pytest.raises(ValueError, match=refusal) as info:
        run_threaded(2, _parallel, net, 2, torch.zeros(1, 3, 16))
    assert "heads" in str(info.value) and "head_dim" in str(info.value)


@settings(max_examples=12)
@given(
    layout=st.sampled_from([(4, 4, 2), (4, 4, 4), (8, 2, 2), (8, 2, 4), (4, 1, 2), (4, 1, 4)]),
    seed=st.integers(0, 2**16),
)
def test_a_fixed_head_width_passes_and_equals_serial(layout: tuple[int, int, int], seed: int) -> None:
    heads, kv_heads, tp = layout
    net = Net(Attention(16, heads, kv_heads, width_from_input=False, seed=seed))
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(seed + 1))
    want = net.mixer(x)
    for rank, got in enumerate(run_threaded(tp, _parallel, net, tp, x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, r=rank: f"rank {r}: {m}")


def _refused_and_unchanged(rank: int, net: Net) -> bool:
    mine = copy.deepcopy(net)
    before = {k: v.clone() for k, v in mine.state_dict().items()}
    with pytest.raises(ValueError, match="do not add up"):
        parallelize(mine, plan=PLAN, mesh=Mesh(Topology(tp=2)))
    same = all(torch.equal(before[k], v) for k, v in mine.state_dict().items())
    return same and isinstance(mine.mixer.q, nn.Linear) and mine.mixer.heads == 4 and mine.training


def test_the_module_is_left_unchanged_when_refused() -> None:
    net = Net(Attention(16, 4, 4, width_from_input=True, seed=2))
    assert run_threaded(2, _refused_and_unchanged, net) == [True, True]


class GatedNorm(nn.Module):
    """Dense layers beside a norm of its own (an adaptive norm: the MLP gates the normalised
    input): not an MLP, whose output would be the row-parallel layer's alone."""

    def __init__(self, d: int, *, gated: bool, seed: int) -> None:
        super().__init__()
        self.gated = gated
        self.norm = nn.RMSNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d, bias=False), nn.Linear(2 * d, d, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        mlp: Tensor = self.fc2(F.silu(self.fc1(x)))
        return self.norm(x) * torch.sigmoid(mlp) if self.gated else mlp


class MLPNet(nn.Module):
    def __init__(self, block: GatedNorm) -> None:
        super().__init__()
        self.block = block


MLP_PLAN = {"block": "region", "block.fc1": "colwise", "block.fc2": "rowwise"}


def _parallel_mlp(rank: int, net: MLPNet, x: Tensor) -> Tensor:
    model = parallelize(copy.deepcopy(net), plan=MLP_PLAN, mesh=Mesh(Topology(tp=2)))
    return model.block(x)


def test_a_region_that_is_not_an_mlp_is_refused_and_an_mlp_passes() -> None:
    """A region whose output is more than its row-parallel layer's (a norm and a gate beside the
    dense layers) is refused naming it; the same dense layers as a plain MLP pass and equal
    the serial module (fp32 round-off: rtol 1e-5, atol 1e-6)."""
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    refusal = r"block \(region\): split over tp=2, the shards of GatedNorm do not add up"
    with pytest.raises(ValueError, match=refusal):
        run_threaded(2, _parallel_mlp, MLPNet(GatedNorm(16, gated=True, seed=4)), x)
    net = MLPNet(GatedNorm(16, gated=False, seed=4))
    want = net.block(x)
    for rank, got in enumerate(run_threaded(2, _parallel_mlp, net, x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, r=rank: f"rank {r}: {m}")
