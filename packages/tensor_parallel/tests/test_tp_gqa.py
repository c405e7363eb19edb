"""Tier 1 (threaded ranks): a user's own grouped-query attention (plain nn.Module, Meta-Llama
style attributes ``n_heads``, ``n_kv_heads``, ``n_rep``, projections ``wq``/``wk``/``wv``/``wo``)
under the ``attention`` style, its sublayers called by keyword, equals the serial model.

Hypothesis draws tp, KV heads (split when tp divides them, replicated when they divide tp),
batch and length. Each rank's loss and every gradient shard, and every split gradient
unsharded by its ``ShardSpec``, are compared with the serial ones: loss to rtol 1e-5, atol
1e-6, gradients to rtol 1e-4, atol 1e-6 (fp32 round-off only: the row-parallel products and
the K/V copies' gradients are summed in another order; a head read from the wrong KV head, a
copy not summed or a wrong shard is off by the size of the gradient). Also: the rule that
finds a sublayer's input in a keyword call, and its error; a column layer over fewer KV
heads than ranks sums its copies' gradients exactly, moving what the formula says.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm import CommMeter, Mesh, Topology
from tessera.comm.testing import run_threaded
from tessera.tensor_parallel import (
    ColumnParallelLinear,
    HeadShardSpec,
    parallelize,
    resolve_plan,
    shard_of,
    shard_specs,
)
from tessera.tensor_parallel.heads import fused_head_indices
from tessera.tensor_parallel.region_style import module_input

VOCAB, D, HEADS = 32, 32, 8


class GQAttention(nn.Module):
    def __init__(self, d: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(d, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d, n_kv_heads * self.head_dim, bias=True)
        self.wv = nn.Linear(d, n_kv_heads * self.head_dim, bias=True)
        self.wo = nn.Linear(n_heads * self.head_dim, d, bias=False)

    def forward(self, x: Tensor, *, causal: bool = True) -> Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.wo(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.down(F.silu(self.up(hidden_states)))  # type: ignore[no-any-return]


class Model(nn.Module):
    def __init__(self, kv: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.norm1, self.norm2 = nn.RMSNorm(D), nn.RMSNorm(D)
        self.attn, self.mlp = GQAttention(D, HEADS, kv), MLP(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.tok(idx)
        h = h + self.attn(x=self.norm1(h), causal=True)  # by keyword, as HF calls its attention
        h = h + self.mlp(hidden_states=self.norm2(h))
        return self.head(h)  # type: ignore[no-any-return]


PLAN = {
    "attn": "attention", "attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise",
    "attn.wo": "rowwise", "mlp": "region", "mlp.up": "colwise", "mlp.down": "rowwise",
}  # fmt: skip


def _rank(rank: int, n: int, kv: int, state: dict[str, Tensor], batch: tuple[Tensor, Tensor],
          grads: dict[str, Tensor]) -> Any:  # fmt: skip
    model = Model(kv)
    model.load_state_dict(state)
    parallelize(model, plan=PLAN, mesh=Mesh(Topology(tp=n)))
    loss = F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())
    loss.backward()
    named = dict(model.named_parameters())
    pairs = {k: (p.grad, shard_of(model, k, grads[k])) for k, p in named.items()}
    attn = model.attn
    assert isinstance(attn, GQAttention)
    local = (attn.n_heads, attn.n_kv_heads, attn.n_rep)
    return loss.detach(), pairs, {k: named[k].grad for k in shard_specs(model)}, shard_specs(model), local


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from([(2, 8), (2, 4), (2, 2), (4, 4), (4, 2), (4, 1), (2, 1)]),  # (tp, kv heads)
    st.integers(1, 3),  # batch
    st.integers(1, 6),  # length
)
def test_user_gqa_attention_parallel_equals_serial(case: tuple[int, int], batch: int, length: int) -> None:
    n, kv = case
    torch.manual_seed(0)
    serial = Model(kv)
    gen = torch.Generator().manual_seed(batch * 10 + length)
    idx = torch.randint(0, VOCAB, (batch, length), generator=gen)
    targets = torch.randint(0, VOCAB, (batch, length), generator=gen)
    loss = F.cross_entropy(serial(idx).flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {k: p.grad for k, p in serial.named_parameters() if p.grad is not None}
    results = run_threaded(n, _rank, n, kv, serial.state_dict(), (idx, targets), grads)
    local_kv = max(1, kv // n)
    for parallel_loss, pairs, _, _, local in results:
        assert local == (HEADS // n, local_kv, HEADS // n // local_kv)
        torch.testing.assert_close(parallel_loss, loss.detach(), rtol=1e-5, atol=1e-6)
        for name, (got, want) in pairs.items():
            try:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
            except AssertionError as error:
                error.add_note(f"in the gradient of {name}")
                raise
    specs = results[0][3]
    kv_names = {f"attn.{p}.{w}" for p in ("wk", "wv") for w in ("weight", "bias")}
    head_specs = {k for k, s in specs.items() if isinstance(s, HeadShardSpec)}
    assert head_specs == (kv_names if kv != HEADS else set())
    for name, spec in specs.items():
        whole = spec.unshard([split[name] for _, _, split, _, _ in results])
        try:
            torch.testing.assert_close(whole, grads[name], rtol=1e-4, atol=1e-6)
        except AssertionError as error:
            error.add_note(f"in the unsharded gradient of {name} ({spec})")
            raise


def test_kv_heads_that_neither_split_nor_replicate_are_refused() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = GQAttention(48, 6, 3)

    plan = {k: v for k, v in PLAN.items() if k.startswith("attn")}
    with pytest.raises(ValueError, match=r"attn \(attention\): .*heads=6, kv_heads=3, tp=2"):
        resolve_plan(Odd(), plan, tp=2)  # pure: refused before any process group is used


def test_the_input_of_a_keyword_call() -> None:
    t, u = torch.zeros(1), torch.ones(1)
    assert module_input((t,), {"hidden_states": u}, where="m") == 0
    assert module_input((), {"attention_mask": u, "hidden_states": t}, where="m") == "hidden_states"
    assert module_input((), {"x": t, "flag": True}, where="m") == "x"
    assert module_input((), {"tokens": t, "flag": True}, where="m") == "tokens"  # the only Tensor
    with pytest.raises(TypeError, match=r"m: cannot tell the input.*\['a', 'b'\]"):
        module_input((), {"a": t, "b": u}, where="m")
    with pytest.raises(TypeError, match="m: the input must be a Tensor, got int first"):
        module_input((3,), {}, where="m")


def _copies(rank: int, heads: int, w: Tensor, b: Tensor, x: Tensor, dys: Tensor) -> Any:
    tp = 4
    layer = ColumnParallelLinear(w.shape[1], w.shape[0], group=Mesh(Topology(tp=tp)).group("tp"),
                                 enter_region=False, blocks=heads, seed=None)  # fmt: skip
    layer.load_full(w, b)
    y = layer(x)
    with CommMeter() as meter:
        y.backward(dys[rank])
    return y.detach(), layer.weight.grad, layer.bias.grad, meter.volume_bytes, layer.weight.numel()


@pytest.mark.parametrize("heads", [1, 2])
def test_kv_head_copies_sum_their_gradients(heads: int) -> None:
    """Four ranks, ``heads`` KV heads of width 3: rank r computes with head ``r*heads//4`` and
    receives its own output gradient; each copy's weight/bias gradient must equal the serial
    gradient of that head for the sum of its copies' output gradients (exact up to fp32
    addition order: rtol 1e-5, atol 1e-6). Backward moves one all-reduce of ``heads`` x the
    local weight gradient and one of ``heads`` x the bias gradient (paper accounting: twice
    the buffer's fp32 bytes)."""
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(3 * heads, 5, generator=gen), torch.randn(3 * heads, generator=gen)
    x, dys = torch.randn(2, 5, generator=gen), torch.randn(4, 2, 3, generator=gen)
    results = run_threaded(4, _copies, heads, w, b, x, dys)
    for rank, (y, gw, gb, moved, numel) in enumerate(results):
        head = rank * heads // 4
        rows = slice(3 * head, 3 * head + 3)
        torch.testing.assert_close(y, x @ w[rows].t() + b[rows], rtol=1e-5, atol=1e-6)
        dy = sum(dys[r] for r in range(4) if r * heads // 4 == head)
        assert isinstance(dy, Tensor)
        torch.testing.assert_close(gw, dy.t() @ x, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gb, dy.sum(0), rtol=1e-5, atol=1e-6)
        assert moved == 2 * heads * (numel + 3) * 4  # all-reduces of (heads, *w) and (heads, *b) fp32


def _fused_copies(rank: int, tp: int, parts: tuple[int, ...], w: Tensor, b: Tensor, x: Tensor,
                  dys: list[Tensor]) -> Any:  # fmt: skip
    layer = ColumnParallelLinear(w.shape[1], w.shape[0], group=Mesh(Topology(tp=tp)).group("tp"),
                                 enter_region=False, blocks=parts, seed=None)  # fmt: skip
    layer.load_full(w, b)
    y = layer(x)
    with CommMeter() as meter:
        y.backward(dys[rank])
    return y.detach(), layer.weight.grad, layer.bias.grad, meter.volume_bytes


@pytest.mark.parametrize(("tp", "kv"), [(2, 1), (4, 2), (4, 1), (2, 2)])
def test_a_fused_qkv_sums_only_its_copied_kv_rows(tp: int, kv: int) -> None:
    """A fused q|k|v of 4 query heads and ``kv`` KV heads of width 3 (``blocks=(4, kv, kv)``): rank r
    holds ``[q_r | k_r | v_r]`` (``fused_head_indices``); with KV heads fewer than tp its K/V rows
    copy one head, and their gradients (only theirs) are summed over the copies, so every rank's
    weight and bias gradient equals the serial gradient of the rows it holds for the sum of all
    ranks' output gradients (exact up to fp32 addition order: rtol 1e-5, atol 1e-6). Backward
    moves one all-reduce of ``kv`` x the copied rows' weight and bias gradients, nothing when the
    KV heads split."""
    parts, width = (4, kv, kv), 3
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(sum(parts) * width, 5, generator=gen), torch.randn(sum(parts) * width, generator=gen)
    index = [torch.tensor(fused_head_indices(w.shape[0], parts, tp, r)) for r in range(tp)]
    x = torch.randn(2, 5, generator=gen)
    dys = [torch.randn(2, len(i), generator=gen) for i in index]
    dy = torch.zeros(2, w.shape[0])
    for i, d in zip(index, dys, strict=True):
        dy.index_add_(1, i, d)  # the serial output gradient: copies' gradients add up
    for rank, (y, gw, gb, moved) in enumerate(run_threaded(tp, _fused_copies, tp, parts, w, b, x, dys)):
        rows = index[rank]
        torch.testing.assert_close(y, x @ w[rows].t() + b[rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gw, (dy.t() @ x)[rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gb, dy.sum(0)[rows], rtol=1e-5, atol=1e-6)
        copied = 2 * width if kv < tp else 0  # one K and one V head
        assert moved == (2 * kv * (copied * 5 + copied) * 4 if copied else 0)
