"""Tier 0: the 2D grid's shard arithmetic (``GridShardSpec``, ``grid_side``) and the plan's
checks (tp not a square, sizes not divisible by q or q*q), all without ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from tessera.models import GPT, GPTConfig
from tessera.tensor_parallel.plan import resolve_plan
from tessera.tensor_parallel.three_d import Cube3D, Embedding3D, VocabEmbedding3D
from tessera.tensor_parallel.two_d import (
    BIAS_SPEC,
    EMBEDDING_SPEC,
    GPT_2D_PLAN,
    WEIGHT_SPEC,
    Embedding2D,
    Grid2D,
    GridShardSpec,
    Linear2D,
    VocabEmbedding2D,
    grid_side,
)


@given(
    q=st.integers(1, 4),
    a=st.integers(1, 3),
    b=st.integers(1, 3),
    same=st.booleans(),
    i_dim=st.integers(0, 1),
)
def test_grid_shards_cover_the_tensor_once_and_unshard_inverts(
    q: int, a: int, b: int, same: bool, i_dim: int
) -> None:
    j_dim = i_dim if same else 1 - i_dim
    spec = GridShardSpec(i_dim=i_dim, j_dim=j_dim)
    shape = [q * q * a, q * q * b] if same else [q * a, q * b]
    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape)
    shards = [spec.shard(full, r, q * q) for r in range(q * q)]
    assert {tuple(s.shape) for s in shards} == {tuple(shards[0].shape)}
    seen = torch.cat([s.flatten() for s in shards]).sort().values
    assert torch.equal(seen, full.flatten())  # every element in exactly one shard
    assert torch.equal(spec.unshard(shards), full)
    # consolidation's path: all-gather along local_dim, chunk into tp shards, unshard
    stacked = torch.cat(shards, spec.local_dim)
    assert torch.equal(spec.unshard(stacked.chunk(q * q, spec.local_dim)), full)


def test_specs_place_blocks_as_the_layers_hold_them() -> None:
    w = torch.arange(16.0).view(4, 4)  # nn.Linear (out, in), q = 2
    # rank 1 = (i=0, j=1): out block j=1 (rows 2, 3), in block i=0 (columns 0, 1)
    assert torch.equal(WEIGHT_SPEC.shard(w, 1, 4), w[2:4, 0:2])
    b = torch.arange(8.0)
    assert torch.equal(BIAS_SPEC.shard(b, 1, 4), b[4:6])  # chunk j*q + i = 2
    e = torch.arange(24.0).view(3, 8)
    assert torch.equal(EMBEDDING_SPEC.shard(e, 2, 4), e[:, 2:4])  # rank 2 = (1, 0): chunk 1


@given(tp=st.integers(1, 400))
def test_grid_side_accepts_exactly_the_squares(tp: int) -> None:
    q = round(tp**0.5)
    if q * q == tp:
        assert grid_side(tp) == q
    else:
        with pytest.raises(ValueError, match=f"tp={tp} is not a square"):
            grid_side(tp)


def test_shard_errors_name_the_numbers() -> None:
    with pytest.raises(ValueError, match="size of dim 0=6 is not divisible by 4"):
        BIAS_SPEC.shard(torch.zeros(6), 0, 4)
    with pytest.raises(ValueError, match="tp=3 is not a square"):
        WEIGHT_SPEC.unshard([torch.zeros(2, 2)] * 3)
    with pytest.raises(ValueError, match="rank 4 is outside"):
        WEIGHT_SPEC.shard(torch.zeros(4, 4), 4, 4)


def _gpt(vocab_size: int = 64, d_model: int = 32, n_heads: int = 4) -> GPT:
    return GPT(GPTConfig(vocab_size=vocab_size, seq_len=8, d_model=d_model, n_heads=n_heads), seed=0)


def test_the_gpt_plan_fits_the_reference_gpt() -> None:
    names = {a.name for a in resolve_plan(_gpt(), GPT_2D_PLAN, tp=4)}
    assert {"embed.tok", "layers.1.attn.q_proj", "head.lm_head", "head.ln_f"} <= names
    assert len(resolve_plan(_gpt(d_model=36, n_heads=3, vocab_size=63), GPT_2D_PLAN, tp=9)) == 3 + 2 * 11 + 2


@pytest.mark.parametrize(
    ("kw", "tp", "message"),
    [
        ({}, 6, "tp=6 is not a square"),
        ({}, 8, "tp=8 is not a square"),
        (
            {"d_model": 34, "n_heads": 2},
            4,
            r"embed.tok \(2d_embedding\): embedding_dim=34 is not divisible by 4",
        ),
        (
            {"vocab_size": 63},
            4,
            r"head.lm_head \(2d_classifier\): vocab \(out_features\)=63 is not divisible by 2",
        ),
        ({"n_heads": 1}, 4, r"layers.0.attn \(2d_attention\): heads=1 is not divisible by 2"),
    ],
)
def test_grids_that_cannot_work_are_value_errors(kw: dict[str, int], tp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_plan(_gpt(**kw), GPT_2D_PLAN, tp=tp)


def test_layer_sizes_are_checked_before_any_group_is_used() -> None:
    from tessera.tensor_parallel.two_d import Grid2D

    grid = Grid2D(q=2, i=0, j=0, row=None, col=None)  # no group is touched by the checks
    with pytest.raises(ValueError, match="in_features=5 is not divisible by 2"):
        Linear2D(5, 8, grid)
    with pytest.raises(ValueError, match="out_features=6 is not divisible by 4"):
        Linear2D(4, 6, grid)
    Linear2D(4, 6, grid, bias=False)


def test_the_2d_and_3d_embeddings_refuse_padding_max_norm_and_sparse() -> None:
    """``from_dense`` refuses what the twins do not implement, before any communication."""
    grid = Grid2D(q=1, i=0, j=0, row=None, col=None)
    cube = Cube3D(q=1, a=0, b=0, c=0, input=None, weight=None, output=None)
    dense = (
        nn.Embedding(4, 4, padding_idx=0),
        nn.Embedding(4, 4, max_norm=1.0),
        nn.Embedding(4, 4, sparse=True),
    )
    for table in dense:
        for cls, where in ((Embedding2D, grid), (VocabEmbedding2D, grid)):
            with pytest.raises(ValueError, match=f"{cls.__name__}: padding_idx, max_norm and sparse"):
                cls.from_dense(table, where)
        for cls3 in (Embedding3D, VocabEmbedding3D):
            with pytest.raises(ValueError, match=f"{cls3.__name__}: padding_idx, max_norm and sparse"):
                cls3.from_dense(table, cube)
    table = nn.Embedding(4, 4)
    twin = Embedding2D.from_dense(table, grid)  # q=1: the whole table, copied
    assert torch.equal(twin.weight, table.weight) and twin.weight.data_ptr() != table.weight.data_ptr()
