"""Tier 0: every shard spec says how many tp ranks hold an identical copy of each element
(``ShardSpec.replicas``), checked against its own ``shard`` by counting the copies.

Exact: the tensors hold distinct integers, each counted over every rank's shard.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.comm import TPMode
from tessera.tensor_parallel import HeadShardSpec, ShardSpec
from tessera.tensor_parallel.nd_styles import FusedShardSpec
from tessera.tensor_parallel.three_d.cube import CubeShardSpec
from tessera.tensor_parallel.two_d.grid import GridShardSpec
from tessera.tensor_parallel.two_p5_d.grid import DepthShardSpec


def _copies(spec: ShardSpec, shape: tuple[int, ...], tp: int) -> set[int]:
    """How many ranks' shards hold each element of a serial tensor of ``shape``."""
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    held = torch.cat([spec.shard(full, r, tp).reshape(-1) for r in range(tp)])
    return set(torch.bincount(held, minlength=full.numel()).tolist())


@given(st.integers(1, 4), st.integers(0, 1))
def test_a_1d_partition_has_one_copy(tp: int, dim: int) -> None:
    spec = ShardSpec(dim)
    assert _copies(spec, (2 * tp, 2 * tp), tp) == {spec.replicas(tp)} == {1}


@settings(max_examples=40)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]))
def test_kv_heads_are_copied_when_tp_exceeds_them(tp: int, heads: int) -> None:
    spec = HeadShardSpec(0, heads=heads)
    shape = (heads * max(1, tp // heads) * 2, 3)  # powers of 2: tp divides heads or heads tp
    assert _copies(spec, shape, tp) == {spec.replicas(tp)}
    assert spec.replicas(tp) == max(1, tp // heads)


@pytest.mark.parametrize("q", [1, 2, 3])
@pytest.mark.parametrize(("i_dim", "j_dim"), [(1, 0), (0, 0), (0, 1), (1, 1)])
def test_2d_and_2p5d_specs(q: int, i_dim: int, j_dim: int) -> None:
    shape = (q * q * 2, q * q * 2)
    grid = GridShardSpec(i_dim=i_dim, j_dim=j_dim)
    assert _copies(grid, shape, q * q) == {grid.replicas(q * q)} == {1}
    for depth in (1, 2, 3):
        deep = DepthShardSpec(i_dim=i_dim, j_dim=j_dim, depth=depth, shape=shape)
        assert _copies(deep, shape, q * q * depth) == {deep.replicas(q * q * depth)} == {depth}
    with pytest.raises(ValueError, match="the depth is unknown"):
        DepthShardSpec(i_dim=i_dim, j_dim=j_dim, shape=shape).replicas(q * q * 2)


@pytest.mark.parametrize("q", [1, 2])
@pytest.mark.parametrize("split", [("ab", "c"), ("", "cba"), ("c",), ("b", "a"), ()])
def test_3d_specs_copy_along_the_axes_they_do_not_name(q: int, split: tuple[str, ...]) -> None:
    spec = CubeShardSpec(split=split)
    shape = (q**3 * 2, q**3 * 2)
    assert _copies(spec, shape, q**3) == {spec.replicas(q**3)} == {q ** len(spec.replicated)}


@pytest.mark.parametrize(
    ("inner", "mode", "depth", "tp"),
    [
        (GridShardSpec(i_dim=1, j_dim=0), TPMode.TWO_D, 1, 4),
        (DepthShardSpec(i_dim=1, j_dim=0, depth=2, shape=(12, 4)), TPMode.TWO_P5_D, 2, 8),
        (CubeShardSpec(split=("ab", "c")), TPMode.THREE_D, 1, 8),
    ],
)
def test_a_fused_spec_has_its_inner_specs_copies(inner: ShardSpec, mode: TPMode, depth: int, tp: int) -> None:
    spec = FusedShardSpec(inner=inner, fused=3, mode=mode, depth=depth)
    assert _copies(spec, (12, 4), tp) == {spec.replicas(tp)} == {inner.replicas(tp)}
