"""Tier 1: each parallel layer against its serial twin on threaded ranks.

Hypothesis draws shapes, tp in {1, 2, 4}, sequence parallelism, bias and dtype in the main
thread, which also runs the serial layer (built from the same seed) with autograd. Each rank
builds its parallel layer from that seed, reads its part of the input (the whole input, or
its slice of the sequence under SP, or its slice of the features for a row-parallel layer
whose input is parallel), and returns its output, input gradient and weight gradients; these
must equal the matching slices of the serial ones. The loss is sum(y * w) for a drawn w, each
rank weighting only the output part it holds, so the ranks' losses add up to the serial one.

Tolerances: fp32 round-off (reductions over ranks reorder sums); bf16: a few bf16 ulps
relative to the largest value, as each summand of a reduction is rounded once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm.testing import run_threaded
from tessera.models.gpt import MLP, Attention, GPTConfig
from tessera.tensor_parallel import (
    ColumnParallelLinear,
    DropoutRNG,
    ParallelDropout,
    ParallelMLP,
    ParallelSelfAttention,
    RNGRegion,
    RowParallelLinear,
    VocabParallelEmbedding,
    seeded_embedding,
    seeded_linear,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)

TPS = st.sampled_from([1, 2, 4])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def close(got: Tensor, want: Tensor, dtype: torch.dtype, floor: float = 1e-2) -> None:
    """fp32: round-off; bf16: 2**-5 of the largest magnitude (a few bf16 ulps). ``floor``
    bounds the scale from below: pass the size of the values a gradient is summed from when
    it may be zero in exact arithmetic (a key bias shifts all scores of a query equally, so
    its gradient is only the round-off of those values)."""
    got, want = got.float(), want.float()
    scale = max(want.abs().max().item(), floor)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=3e-2 * scale)


def grad_scale(grads: dict[str, Tensor]) -> float:
    """The round-off floor for a module's gradients: 1/100 of the largest, at least 1e-2."""
    return max(1e-2, 1e-2 * max(g.abs().max().item() for g in grads.values()))


def chunk(x: Tensor, dim: int, n: int, r: int) -> Tensor:
    return x.chunk(n, dim)[r]


def serial_run(module: nn.Module, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    leaf = x.clone().requires_grad_(x.is_floating_point())
    y = module(leaf)
    (y.float() * w.float()).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return y.detach(), (leaf.grad if leaf.requires_grad else None), grads


def rank_run(layer: nn.Module, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor | None, dict[str, Any]]:
    leaf = x.clone().requires_grad_(x.is_floating_point())
    y = layer(leaf)
    (y.float() * w.float()).sum().backward()
    sync_sequence_parallel_grads(layer, None)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), (leaf.grad if leaf.requires_grad else None), grads


@st.composite
def dense_case(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(TPS)
    return {
        "n": n,
        "b": draw(st.integers(1, 3)),
        "s": n * draw(st.integers(1, 3)),
        "i": n * draw(st.integers(1, 4)),
        "o": n * draw(st.integers(1, 4)),
        "bias": draw(st.booleans()),
        "sp": draw(st.booleans()),
        "dtype": draw(DTYPES),
        "seed": draw(st.integers(0, 2**20)),
    }


def _column(rank: int, c: dict[str, Any], gather: bool, x: Tensor, w: Tensor) -> Any:
    n, sp = c["n"], c["sp"]
    layer = ColumnParallelLinear(
        c["i"],
        c["o"],
        group=None,
        bias=c["bias"],
        gather_output=gather,
        sequence_parallel=sp,
        seed=c["seed"],
        dtype=c["dtype"],
    )
    x_r = chunk(x, 1, n, rank) if sp else x
    w_r = w if gather else chunk(w, -1, n, rank)
    return (*rank_run(layer, x_r, w_r), layer)


@settings(max_examples=30)
@given(dense_case(), st.booleans())
def test_column_parallel_linear(c: dict[str, Any], gather: bool) -> None:
    n, dtype, sp = c["n"], c["dtype"], c["sp"]
    gen = torch.Generator().manual_seed(c["seed"])
    x = torch.randn(c["b"], c["s"], c["i"], generator=gen).to(dtype)
    w = torch.randn(c["b"], c["s"], c["o"], generator=gen)
    serial = seeded_linear(c["i"], c["o"], bias=c["bias"], seed=c["seed"], dtype=dtype)
    y, gx, grads = serial_run(serial, x, w)
    for rank, (y_r, gx_r, g_r, layer) in enumerate(run_threaded(n, _column, c, gather, x, w)):
        close(y_r, y if gather else chunk(y, -1, n, rank), dtype)
        assert gx is not None and gx_r is not None
        close(gx_r, chunk(gx, 1, n, rank) if sp else gx, dtype)
        for name, g in g_r.items():
            close(g, layer.shard_of(name, grads[name]), dtype)
        assert set(g_r) == set(grads)


def _row(rank: int, c: dict[str, Any], parallel_in: bool, x: Tensor, w: Tensor) -> Any:
    n, sp = c["n"], c["sp"]
    layer = RowParallelLinear(
        c["i"],
        c["o"],
        group=None,
        bias=c["bias"],
        input_is_parallel=parallel_in,
        sequence_parallel=sp,
        seed=c["seed"],
        dtype=c["dtype"],
    )
    x_r = chunk(x, -1, n, rank) if parallel_in else x
    w_r = chunk(w, 1, n, rank) if sp else w
    return (*rank_run(layer, x_r, w_r), layer)


@settings(max_examples=30)
@given(dense_case(), st.booleans())
def test_row_parallel_linear(c: dict[str, Any], parallel_in: bool) -> None:
    n, dtype, sp = c["n"], c["dtype"], c["sp"]
    gen = torch.Generator().manual_seed(c["seed"])
    x = torch.randn(c["b"], c["s"], c["i"], generator=gen).to(dtype)
    w = torch.randn(c["b"], c["s"], c["o"], generator=gen)
    serial = seeded_linear(c["i"], c["o"], bias=c["bias"], seed=c["seed"], dtype=dtype)
    y, gx, grads = serial_run(serial, x, w)
    assert gx is not None
    for rank, (y_r, gx_r, g_r, layer) in enumerate(run_threaded(n, _row, c, parallel_in, x, w)):
        close(y_r, chunk(y, 1, n, rank) if sp else y, dtype)
        close(gx_r, chunk(gx, -1, n, rank) if parallel_in else gx, dtype)
        assert set(g_r) == set(grads)
        for name, g in g_r.items():  # the SP bias gradient was summed by sync_sequence_parallel_grads
            close(g, layer.shard_of(name, grads[name]), dtype)


def _embedding(rank: int, c: dict[str, Any], vocab: int, pad: int | None, idx: Tensor, w: Tensor) -> Any:
    n, sp = c["n"], c["sp"]
    layer = VocabParallelEmbedding(
        vocab, c["o"], group=None, padding_idx=pad, sequence_parallel=sp, seed=c["seed"], dtype=c["dtype"]
    )
    return (*rank_run(layer, idx, chunk(w, 1, n, rank) if sp else w), layer)


@settings(max_examples=30)
@given(dense_case(), st.integers(1, 8), st.booleans())
def test_vocab_parallel_embedding(c: dict[str, Any], per_rank: int, padded: bool) -> None:
    n, dtype, sp = c["n"], c["dtype"], c["sp"]
    vocab = n * per_rank
    pad = c["seed"] % vocab if padded else None
    gen = torch.Generator().manual_seed(c["seed"])
    idx = torch.randint(0, vocab, (c["b"], c["s"]), generator=gen)
    w = torch.randn(c["b"], c["s"], c["o"], generator=gen)
    serial = seeded_embedding(vocab, c["o"], seed=c["seed"], padding_idx=pad, dtype=dtype)
    y, _, grads = serial_run(serial, idx, w)
    for rank, (y_r, _, g_r, layer) in enumerate(run_threaded(n, _embedding, c, vocab, pad, idx, w)):
        close(y_r, chunk(y, 1, n, rank) if sp else y, dtype)
        assert set(g_r) == set(grads) == {"weight"}
        close(g_r["weight"], layer.shard_of("weight", grads["weight"]), dtype)


def _cross_entropy(rank: int, n: int, logits: Tensor, targets: Tensor, reduction: str, w: Tensor) -> Any:
    leaf = chunk(logits, -1, n, rank).clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(leaf, targets, None, ignore_index=-100, reduction=reduction)  # type: ignore[arg-type]
    (loss.float() * w).sum().backward()
    return loss.detach(), leaf.grad


@settings(max_examples=40)
@given(
    TPS,
    st.integers(1, 6),
    st.integers(1, 8),
    DTYPES,
    st.sampled_from(["mean", "sum", "none"]),
    st.integers(0, 2**20),
)
def test_vocab_parallel_cross_entropy_equals_cross_entropy_on_gathered_logits(
    n: int, tokens: int, per_rank: int, dtype: torch.dtype, reduction: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab = n * per_rank
    logits = (3 * torch.randn(2, tokens, vocab, generator=gen)).to(dtype)
    targets = torch.randint(0, vocab, (2, tokens), generator=gen)
    targets[1, ::2] = -100  # ignored, but never every token
    w = torch.randn(targets.shape if reduction == "none" else (), generator=gen)
    leaf = logits.float().clone().requires_grad_(True)
    ref = F.cross_entropy(leaf.flatten(0, 1), targets.flatten(), reduction=reduction)
    ref = ref.view(targets.shape) if reduction == "none" else ref
    (ref * w).sum().backward()
    assert leaf.grad is not None
    for rank, (loss, grad) in enumerate(run_threaded(n, _cross_entropy, n, logits, targets, reduction, w)):
        # a sum over many tokens stays in fp32 (it can leave a half precision's range)
        assert loss.dtype == (torch.float32 if reduction == "sum" else dtype)
        close(loss, ref.detach(), dtype)
        close(grad, chunk(leaf.grad, -1, n, rank), dtype)


def _block(rank: int, kind: str, c: dict[str, Any], heads: int, x: Tensor, w: Tensor) -> Any:
    n, sp, d = c["n"], c["sp"], c["i"]
    if kind == "mlp":
        layer: nn.Module = ParallelMLP(
            d, c["o"], group=None, bias=c["bias"], sequence_parallel=sp, seed=c["seed"], dtype=c["dtype"]
        )
    else:
        layer = ParallelSelfAttention(
            d, heads, group=None, bias=c["bias"], sequence_parallel=sp, seed=c["seed"], dtype=c["dtype"]
        )
    x_r, w_r = (chunk(x, 1, n, rank), chunk(w, 1, n, rank)) if sp else (x, w)
    y, gx, grads = rank_run(layer, x_r, w_r)
    return y, gx, grads, {k: layer.get_submodule(k.rpartition(".")[0]) for k in grads}


@settings(max_examples=30)
@given(dense_case(), st.sampled_from(["mlp", "attention"]), st.integers(1, 2))
def test_parallel_blocks_equal_their_serial_twins(c: dict[str, Any], kind: str, heads_per_rank: int) -> None:
    n, dtype, sp, d = c["n"], c["dtype"], c["sp"], c["i"]
    heads = n * heads_per_rank
    d = heads * max(1, d // n)  # whole heads
    c = {**c, "i": d}
    cfg = GPTConfig(d_model=d, n_heads=heads, mlp_ratio=1, bias=c["bias"])
    seeds = [c["seed"] + i for i in range(4)]
    if kind == "mlp":
        serial: nn.Module = MLP(cfg)
        serial.fc_in = seeded_linear(d, c["o"], bias=c["bias"], seed=seeds[0], dtype=dtype)
        serial.fc_out = seeded_linear(c["o"], d, bias=c["bias"], seed=seeds[1], dtype=dtype)
    else:
        serial = Attention(cfg)
        for i, name in enumerate(("q_proj", "k_proj", "v_proj", "out_proj")):
            setattr(serial, name, seeded_linear(d, d, bias=c["bias"], seed=seeds[i], dtype=dtype))
    gen = torch.Generator().manual_seed(c["seed"])
    x = torch.randn(c["b"], c["s"], d, generator=gen).to(dtype)
    w = torch.randn(c["b"], c["s"], d, generator=gen)
    y, gx, grads = serial_run(serial, x, w)
    assert gx is not None
    for rank, (y_r, gx_r, g_r, owners) in enumerate(run_threaded(n, _block, kind, c, heads, x, w)):
        close(y_r, chunk(y, 1, n, rank) if sp else y, dtype)
        close(gx_r, chunk(gx, 1, n, rank) if sp else gx, dtype)
        assert set(g_r) == set(grads)
        for name, g in g_r.items():
            close(g, owners[name].shard_of(name.rpartition(".")[2], grads[name]), dtype, grad_scale(grads))


def _dropout(rank: int, x: Tensor) -> dict[str, Tensor]:
    rng = DropoutRNG(seed=3, tp_rank=rank)
    out = {}
    for region in RNGRegion:
        drop = ParallelDropout(0.5, rng, region)
        out[region.value] = drop(x)
        out[region.value + "-eval"] = drop.eval()(x)
    return out


def test_parallel_dropout_masks_are_shared_when_replicated_and_differ_when_split() -> None:
    x = torch.ones(64, 8)
    outs = run_threaded(4, _dropout, x)
    for out in outs:
        for region in RNGRegion:
            # some dropped, the rest scaled by 1/(1-p) (512 draws at p=0.5: never all one kind)
            assert set(out[region.value].unique().tolist()) == {0.0, 2.0}
            assert torch.equal(out[region.value + "-eval"], x)
    assert all(torch.equal(o["replicated"], outs[0]["replicated"]) for o in outs)
    assert all(not torch.equal(o["split"], outs[0]["split"]) for o in outs[1:])


def _seeded(rank: int, n: int) -> list[tuple[Tensor, Tensor]]:
    column = ColumnParallelLinear(8, 4 * n, group=None, seed=1)
    fused = ColumnParallelLinear(8, 6 * n, group=None, sections=3, seed=2)
    row = RowParallelLinear(4 * n, 8, group=None, seed=3)
    vocab = VocabParallelEmbedding(5 * n, 8, group=None, seed=4)
    twins = [
        seeded_linear(8, 4 * n, seed=1),
        seeded_linear(8, 6 * n, seed=2),
        seeded_linear(4 * n, 8, seed=3),
    ]
    out = []
    for layer, twin in zip((column, fused, row), twins, strict=True):
        out += [
            (layer.weight, layer.shard_of("weight", twin.weight)),
            (layer.bias, layer.shard_of("bias", twin.bias)),
        ]
    out.append((vocab.weight, vocab.shard_of("weight", seeded_embedding(5 * n, 8, seed=4).weight)))
    return [(a.detach(), b.detach()) for a, b in out]


def test_a_layer_built_with_a_seed_holds_exactly_its_slice_of_the_serial_twin() -> None:
    for n in (1, 2, 4):
        for rank, pairs in enumerate(run_threaded(n, _seeded, n)):
            for got, want in pairs:
                assert torch.equal(got, want), (n, rank)
