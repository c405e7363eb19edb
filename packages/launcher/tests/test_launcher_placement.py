"""Tier 1: a rank's part of a serial tensor (``local_part``), the one cut that deferred
initialization and resharding checkpoints both use."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.launcher.checkpoint.placement import Placement, local_part
from tessera.tensor_parallel import ShardSpec


@settings(max_examples=40, deadline=None)
@given(
    banks=st.integers(1, 3),
    per_rank=st.integers(1, 3),
    tp=st.sampled_from([1, 2, 4]),
    dim=st.integers(1, 2),
    data=st.data(),
)
def test_the_parts_of_every_rank_put_back_together_are_the_serial_tensor(
    banks: int, per_rank: int, tp: int, dim: int, data: st.DataObject
) -> None:
    """An expert bank of ``banks * per_rank`` experts over ``banks`` ep ranks, each slice split
    over tp along ``dim``: joining every rank's part in rank order gives the serial tensor back."""
    full = torch.arange(banks * per_rank * 4 * 8, dtype=torch.float32).reshape(banks * per_rank, 4, 8)
    spec = ShardSpec(dim=dim)
    slices = []
    for ep in range(banks):
        span = (ep * per_rank, (ep + 1) * per_rank)
        place = Placement(
            names={}, full_shapes={}, replicated={}, shard_specs={"w": spec}, experts={"w": span}
        )
        shape = list(full.shape)
        shape[0], shape[dim] = per_rank, shape[dim] // tp
        parts = [place.part(full, "w", r, tp, shape) for r in range(tp)]
        slices.append(torch.cat(parts, dim))
    torch.testing.assert_close(
        torch.cat(slices, 0), full, rtol=0, atol=0, msg="parts do not join to the whole"
    )
    whole = local_part(
        full, "other", {"w": spec}, {"w": (0, 1)}, data.draw(st.integers(0, tp - 1)), tp, full.shape
    )
    assert whole is full  # a name neither map knows is whole on every rank


def test_a_part_of_the_wrong_shape_names_the_shapes_and_the_rank() -> None:
    full = torch.zeros(8, 6)
    with pytest.raises(
        ValueError,
        match=r"w: the serial \(8, 6\) gives \(2, 3\) on experts 2\.\.3, tp rank 1 of 2; "
        r"the parameter is \(2, 6\)",
    ):
        local_part(full, "w", {"w": ShardSpec(dim=1)}, {"w": (2, 4)}, 1, 2, (2, 6))
