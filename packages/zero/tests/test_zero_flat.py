"""Tier 0: the pure pieces (shard arithmetic, buckets, unit ownership, loss scaler, clipping)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tessera.models import GPT, GPTConfig
from tessera.zero import DynamicLossScaler, clip_coefficient, default_units
from tessera.zero.flat import FlatLayout, bucketize
from tessera.zero.precision import compute_dtype
from tessera.zero.precisions import ELEMENT_BYTES, Precision
from tessera.zero.units import assign_params
from tessera.zero.validate import ZeroOptions

NUMELS = st.lists(st.integers(0, 300), min_size=1, max_size=12)


@settings(max_examples=200)
@given(NUMELS, st.integers(1, 9), st.integers(1, 8))
def test_layout_places_every_element_once_and_shards_evenly(
    numels: list[int], world: int, align: int
) -> None:
    layout = FlatLayout(tuple(numels), world, align)
    covered = [0] * layout.padded_numel
    for i in range(len(numels)):
        start, stop = layout.span(i)
        assert stop - start == numels[i]
        for k in range(start, stop):
            covered[k] += 1
    assert covered[: layout.numel] == [1] * layout.numel and sum(covered) == sum(numels)
    assert layout.padded_numel == world * layout.shard_numel >= max(layout.numel, world)
    assert layout.shard_numel % align == 0
    assert 0 <= layout.padding < world * align or layout.numel == 0
    ranges = [layout.shard_range(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    for i in range(len(numels)):
        start, stop = layout.span(i)
        owners = layout.owners(i)
        hit = [r for r, (lo, hi) in enumerate(ranges) if lo < stop and start < hi]
        assert owners == (tuple(hit) if stop > start else ())


def test_layout_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout((3,), 0)
    with pytest.raises(ValueError, match="align"):
        FlatLayout((3,), 2, 0)
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        FlatLayout((3,), 2).shard_range(2)


@settings(max_examples=200)
@given(st.lists(st.integers(0, 100), max_size=30), st.integers(1, 150))
def test_buckets_are_consecutive_and_capped(sizes: list[int], cap: int) -> None:
    buckets = bucketize(sizes, cap)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    for b in buckets:
        assert b and (sum(sizes[i] for i in b) <= cap or len(b) == 1)
    for a, b in itertools.pairwise(buckets):  # greedy: the next item did not fit
        assert sum(sizes[i] for i in a) + sizes[b[0]] > cap


def test_default_units_of_the_gpt_are_its_blocks() -> None:
    model = GPT(GPTConfig())
    assert default_units(model) == model.blocks()
    owned = assign_params(model, default_units(model))
    assert owned[0][0] is model and owned[0][1] == []
    names = [n for _, pairs in owned for n, _ in pairs]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


class _Wrapper(nn.Module):
    """A module on the way to the layer stack, as Hugging Face's ``LlamaModel`` under
    ``LlamaForCausalLM.model``: an embedding, the layers, a norm, and a bare Parameter."""

    def __init__(self, inner: nn.Module, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, width)
        self.inner = inner
        self.norm = nn.LayerNorm(width)
        self.scale = nn.Parameter(torch.ones(width))


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 3), st.integers(1, 5), st.integers(2, 6))
def test_a_nested_layer_stack_gives_one_unit_per_layer(depth: int, layers: int, width: int) -> None:
    """Wherever the layers sit (``layers``, ``model.layers``, deeper), each is a unit of its
    own, the modules around them on the way are units too, and every parameter is owned once:
    stage 3 never gathers the whole trunk at once."""
    stack = nn.ModuleList(
        nn.Sequential(nn.Linear(width, 3 * width), nn.Linear(3 * width, width)) for _ in range(layers)
    )
    model: nn.Module = stack
    wrappers = []
    for _ in range(depth):
        model = _Wrapper(model, width)
        wrappers.append(model)
    top = nn.Sequential(model, nn.Linear(width, 11)) if depth else nn.Sequential(stack)
    units = default_units(top)
    for layer in stack:
        assert any(u is layer for u in units), f"layer {layer} is not a unit of its own: {units}"
    for w in wrappers:
        assert not any(u is w for u in units), "a module on the way to the layers was kept whole"
        for part in (w.embed, w.norm):
            assert any(u is part for u in units), f"{part} around the layers is not a unit"
    owned = assign_params(top, units)
    names = [n for _, pairs in owned for n, _ in pairs]
    assert sorted(names) == sorted(n for n, _ in top.named_parameters())
    at_root = {n for n, _ in owned[0][1]}
    assert at_root == {n for n, _ in top.named_parameters() if n.endswith("scale")}


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_tied_parameters_belong_to_the_unit_enclosing_every_use() -> None:
    model = _Tied()
    owned = {id(u): [n for n, _ in pairs] for u, pairs in assign_params(model, default_units(model))}
    assert owned[id(model)] == ["embed.weight"]
    assert owned[id(model.head)] == [] and owned[id(model.mid)] == ["mid.weight", "mid.bias"]
    outer = nn.Sequential(nn.Linear(2, 2), model)  # the tie lives inside the unit outer[1]
    owned = {id(u): [n for n, _ in pairs] for u, pairs in assign_params(outer, [outer[0], model, model.mid])}
    assert owned[id(model)] == ["1.embed.weight"]
    with pytest.raises(ValueError, match="submodules of the model"):
        assign_params(model, [nn.Linear(2, 2)])


def test_loss_scaler_backs_off_and_grows() -> None:
    s = DynamicLossScaler(8.0, growth_interval=2, min_scale=2.0)
    s.update(True)
    assert s.scale == 4.0 and s.skipped_steps == 1
    s.update(True)
    s.update(True)
    assert s.scale == 2.0  # floored at min_scale
    s.update(False)
    assert s.scale == 2.0
    s.update(False)
    assert s.scale == 4.0
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)


@given(st.floats(0, 1e6, allow_nan=False), st.floats(1e-3, 1e3))
def test_clip_coefficient_matches_clip_grad_norm(norm: float, max_norm: float) -> None:
    g = torch.tensor([norm], dtype=torch.float64)
    g.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([g], max_norm)
    assert g.grad is not None
    want = norm * clip_coefficient(norm, max_norm)
    assert math.isclose(float(g.grad[0]), want, rel_tol=1e-12, abs_tol=1e-300)


def test_config_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match=r"stage must be 0 \(plain data parallelism\), 1, 2 or 3, got 4"):
        ZeroOptions(4)
    with pytest.raises(ValueError, match="'fp8'"):
        ZeroOptions(1, "fp8")
    with pytest.raises(ValueError, match="clip_grad_norm must be > 0 or None, got 0"):
        ZeroOptions(1, clip_grad_norm=0)
    with pytest.raises(ValueError, match="bucket_bytes"):
        ZeroOptions(2, bucket_bytes=0)
    assert compute_dtype("bf16") == torch.bfloat16


def test_element_bytes_are_each_precisions_dtype_size() -> None:
    """The torch-free sizes (what the planner counts with) agree with the dtypes ZeRO computes in."""
    assert set(ELEMENT_BYTES) == set(Precision)
    for precision, size in ELEMENT_BYTES.items():
        assert compute_dtype(precision).itemsize == size, precision
