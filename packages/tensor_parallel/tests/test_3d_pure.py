"""Tier 0: the 3D cube's shard arithmetic (``CubeShardSpec``, ``cube_side``, ``cube_coords``
against the topology) and the plan's checks (tp not a cube, sizes not divisible by q, q*q or
q**3, batch not divisible by q*q), all without ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tessera.comm import Topology, TPMode
from tessera.models import GPT, GPTConfig
from tessera.tensor_parallel.plan import resolve_plan
from tessera.tensor_parallel.three_d import (
    EMBEDDING_SPEC,
    GPT_3D_PLAN,
    GPT_3D_VOCAB_PLAN,
    VOCAB_EMBEDDING_SPEC,
    Cube3D,
    CubeShardSpec,
    Linear3D,
    batch_block,
    bias_spec,
    cube_coords,
    cube_side,
    norm_spec,
    weight_spec,
)

splits = st.permutations("abc").flatmap(
    lambda p: st.tuples(st.integers(0, 3), st.integers(0, 3)).map(
        lambda cut: ("".join(p)[: min(cut)], "".join(p)[min(cut) : max(cut)])
    )
)


@given(q=st.integers(1, 3), split=splits, m=st.integers(1, 2), n=st.integers(1, 2))
def test_cube_shards_are_equal_cover_the_tensor_and_unshard_inverts(
    q: int, split: tuple[str, str], m: int, n: int
) -> None:
    spec = CubeShardSpec(split=split)
    shape = [q ** len(split[0]) * m, q ** len(split[1]) * n]
    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape)
    shards = [spec.shard(full, r, q**3) for r in range(q**3)]
    assert {tuple(s.shape) for s in shards} == {tuple(shards[0].shape)}
    copies = q ** len(spec.replicated)  # each element is held once per replica
    seen = torch.cat([s.flatten() for s in shards]).sort().values
    assert torch.equal(seen, full.flatten().repeat_interleave(copies))
    assert torch.equal(spec.unshard(shards), full)


def test_the_layer_specs_cut_every_axis_so_no_parameter_has_replicas() -> None:
    specs = [
        weight_spec(False),
        weight_spec(True),
        bias_spec(False),
        bias_spec(True),
        norm_spec(),
        EMBEDDING_SPEC,
        VOCAB_EMBEDDING_SPEC,
    ]
    assert all(s.replicated == "" for s in specs)
    assert weight_spec(False).split == ("ab", "c") and weight_spec(True).split == ("cb", "a")


@given(q=st.integers(1, 4), rank=st.integers(0, 63))
def test_cube_coords_are_the_topology_coordinates(q: int, rank: int) -> None:
    topo = Topology(tp=q**3, tp_mode=TPMode.THREE_D)
    rank %= q**3
    coords = cube_coords(rank, q)
    assert coords == {
        "a": topo.coordinate(rank, "tp_input"),
        "b": topo.coordinate(rank, "tp_weight"),
        "c": topo.coordinate(rank, "tp_output"),
    }


@pytest.mark.parametrize("tp", [2, 4, 9, 26, 63])
def test_tp_not_a_cube_is_named(tp: int) -> None:
    with pytest.raises(ValueError, match=f"tp={tp} is not a cube"):
        cube_side(tp)


def test_cube_side() -> None:
    assert [cube_side(q**3) for q in range(1, 6)] == [1, 2, 3, 4, 5]


def test_invalid_specs_are_refused() -> None:
    for split in (("aa",), ("ab", "b"), ("x",)):
        with pytest.raises(ValueError, match="split names each of a, b, c at most once"):
            CubeShardSpec(split=split)


def _gpt(*, vocab_size: int = 64, d_model: int = 32, n_heads: int = 4) -> GPT:
    cfg = GPTConfig(vocab_size=vocab_size, seq_len=8, d_model=d_model, n_heads=n_heads, n_layers=2)
    return GPT(cfg)


def test_the_gpt_plan_resolves_at_tp_8() -> None:
    names = {a.name for a in resolve_plan(_gpt(), GPT_3D_PLAN, tp=8)}
    assert {"embed.tok", "layers.1.attn.q_proj", "layers.1.mlp.fc_out", "head.lm_head", "head.ln_f"} <= names
    assert len(resolve_plan(_gpt(), GPT_3D_VOCAB_PLAN, tp=8)) == len(resolve_plan(_gpt(), GPT_3D_PLAN, tp=8))


def test_the_vocab_plan_names_a_vocabulary_the_cube_cannot_cut() -> None:
    with pytest.raises(ValueError, match=r"embed.tok \(3d_vocab_embedding\).*=66 is not divisible by 4"):
        resolve_plan(_gpt(vocab_size=66), GPT_3D_VOCAB_PLAN, tp=8)


@pytest.mark.parametrize(
    ("kw", "tp", "message"),
    [
        ({}, 4, "tp=4 is not a cube"),
        ({"d_model": 36, "n_heads": 4}, 8, "embedding_dim=36 is not divisible by 8"),
        ({"d_model": 24, "n_heads": 3}, 8, "heads=3 is not divisible by 2"),
        ({"vocab_size": 62}, 8, "vocab \\(out_features\\)=62 is not divisible by 4"),
    ],
)
def test_the_plan_names_what_does_not_fit(kw: dict[str, int], tp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_plan(_gpt(**kw), GPT_3D_PLAN, tp=tp)


def test_layer_and_batch_sizes_are_checked_before_any_group_is_used() -> None:
    cube = Cube3D(q=2, a=1, b=0, c=1, input=None, weight=None, output=None)  # no group is touched
    with pytest.raises(ValueError, match="in_features=5 is not divisible by 2"):
        Linear3D(5, 8, cube)
    with pytest.raises(ValueError, match="out_features=12 is not divisible by 8"):
        Linear3D(4, 12, cube)
    Linear3D(4, 12, cube, bias=False)  # q*q divides it: fine without a bias
    with pytest.raises(ValueError, match=r"batch \(dim 0 of \(6, 3\)\)=6 is not divisible by 4"):
        batch_block(torch.zeros(6, 3), cube)
    x = torch.arange(8)
    assert batch_block(x, cube).tolist() == [2, 3] and batch_block(x, cube, branch=True).tolist() == [2, 3]
    assert batch_block(x, Cube3D(2, 1, 1, 0, None, None, None), branch=True).tolist() == [4, 5]
