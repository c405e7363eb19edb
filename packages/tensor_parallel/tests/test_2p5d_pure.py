"""Tier 0: the 2.5D grid's shard arithmetic (``DepthShardSpec``, ``tesseract_side``,
``check_batch_2p5d``) and the plan's checks (tp not q*q*depth, sizes not divisible by q or
q*q), all without ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tessera.models import GPT, GPTConfig
from tessera.tensor_parallel.plan import Plan, resolve_plan
from tessera.tensor_parallel.style import style_named
from tessera.tensor_parallel.two_d import GridShardSpec
from tessera.tensor_parallel.two_p5_d import (
    GPT_2P5D_PLAN,
    DepthShardSpec,
    Grid2p5D,
    Style2p5D,
    bind_2p5d,
    check_batch_2p5d,
    tesseract_side,
)


@given(
    q=st.integers(1, 3),
    d=st.integers(1, 3),
    a=st.integers(1, 3),
    b=st.integers(1, 3),
    same=st.booleans(),
    i_dim=st.integers(0, 1),
)
def test_depth_shards_are_the_2d_shards_on_every_layer_and_unshard_inverts(
    q: int, d: int, a: int, b: int, same: bool, i_dim: int
) -> None:
    j_dim = i_dim if same else 1 - i_dim
    shape = (q * q * a, q * q * b) if same else (q * a, q * b)
    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape)
    flat = GridShardSpec(i_dim=i_dim, j_dim=j_dim)
    spec = DepthShardSpec(i_dim=i_dim, j_dim=j_dim, depth=d)
    tp = q * q * d
    shards = [spec.shard(full, r, tp) for r in range(tp)]
    for r in range(tp):
        assert torch.equal(shards[r], flat.shard(full, r % (q * q), q * q))  # replicated over k
    # consolidation's path: all-gather along local_dim, chunk into tp shards, unshard
    stacked = torch.cat(shards, spec.local_dim).chunk(tp, spec.local_dim)
    assert torch.equal(spec.unshard(stacked), full)
    by_shape = DepthShardSpec(i_dim=i_dim, j_dim=j_dim, shape=shape)  # depth unknown: q from shapes
    assert torch.equal(by_shape.unshard(stacked), full)


def test_a_spec_without_depth_finds_q_from_the_serial_shape() -> None:
    w = torch.arange(64.0).view(8, 8)  # tp = 16 is 2x2x4 or 4x4x1: the shards' shape decides
    for d in (4, 1):  # 2x2x4, 4x4x1
        shards = [DepthShardSpec(i_dim=1, j_dim=0, depth=d).shard(w, r, 16) for r in range(16)]
        assert torch.equal(DepthShardSpec(i_dim=1, j_dim=0, shape=(8, 8)).unshard(shards), w)
    with pytest.raises(ValueError, match="the depth is unknown"):
        DepthShardSpec(i_dim=1, j_dim=0, shape=(8, 8)).shard(w, 0, 16)
    with pytest.raises(ValueError, match="needs its depth or the serial shape"):
        DepthShardSpec(i_dim=1, j_dim=0)


@given(tp=st.integers(1, 200), depth=st.integers(1, 8))
def test_tesseract_side_accepts_exactly_q_q_depth(tp: int, depth: int) -> None:
    q = round((tp / depth) ** 0.5)
    if q * q * depth == tp:
        assert tesseract_side(tp, depth) == q
    else:
        with pytest.raises(ValueError, match=f"tp={tp} is not q\\*q\\*depth"):
            tesseract_side(tp, depth)


def test_batch_and_grid_errors_name_the_numbers() -> None:
    check_batch_2p5d(8, 2, 2, where="here")
    with pytest.raises(ValueError, match=r"here: batch=6 is not divisible by q\*depth = 2\*2 = 4"):
        check_batch_2p5d(6, 2, 2, where="here")
    with pytest.raises(ValueError, match="invalid depth index k=2 for depth d=2"):
        Grid2p5D(q=2, i=0, j=0, row=None, col=None, d=2, k=2, dep=None)
    with pytest.raises(ValueError, match="rank 8 is outside"):
        DepthShardSpec(i_dim=1, j_dim=0, depth=2).shard(torch.zeros(4, 4), 8, 8)


def _gpt(vocab_size: int = 64, d_model: int = 32, n_heads: int = 4) -> GPT:
    return GPT(GPTConfig(vocab_size=vocab_size, seq_len=8, d_model=d_model, n_heads=n_heads), seed=0)


def _bound(d: int = 2) -> Plan:
    return bind_2p5d(GPT_2P5D_PLAN, Grid2p5D(q=2, i=0, j=0, row=None, col=None, d=d, k=0, dep=None))


def test_the_gpt_plan_names_registered_styles_and_fits_the_reference_gpt() -> None:
    assert isinstance(style_named("2.5d_linear"), Style2p5D)
    names = {a.name for a in resolve_plan(_gpt(), _bound(), tp=8)}
    assert {"embed.tok", "layers.1.attn.q_proj", "head.lm_head", "head.ln_f"} <= names
    assert len(resolve_plan(_gpt(), GPT_2P5D_PLAN, tp=8)) == len(names)


@pytest.mark.parametrize(
    ("kw", "tp", "message"),
    [
        ({}, 7, r"tp=7 is not q\*q\*depth: depth=2 does not divide it"),
        ({}, 12, r"tp=12 is not q\*q\*depth: tp/depth = 6 is not a square"),
        (
            {"d_model": 34, "n_heads": 2},
            8,
            r"embed.tok \(2.5d_embedding\): embedding_dim=34 is not divisible by 4 .*\(tp=8, q=2\)",
        ),
        (
            {"vocab_size": 63},
            8,
            r"head.lm_head \(2.5d_classifier\): vocab \(out_features\)=63 is not divisible by 2",
        ),
        ({"n_heads": 1}, 8, r"layers.0.attn \(2.5d_attention\): heads=1 is not divisible by 2"),
    ],
)
def test_grids_that_cannot_work_are_value_errors(kw: dict[str, int], tp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_plan(_gpt(**kw), _bound(), tp=tp)
