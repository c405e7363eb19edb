"""Tier 0: ``split_microbatches`` cuts a batch into ``m`` equal row slices, in order, and
refuses, naming the tensor and its shape, a batch whose rows do not split."""

from __future__ import annotations

import pytest
import torch

from tessera.pipeline import split_microbatches


@pytest.mark.parametrize("m", [1, 2, 3, 6])
def test_equal_slices_in_order(m: int) -> None:
    batch = torch.arange(6 * 4).reshape(6, 4)
    parts = split_microbatches(batch, m)
    assert len(parts) == m
    assert all(p.shape == (6 // m, 4) for p in parts)
    assert torch.equal(torch.cat(parts), batch)
    assert all(p.data_ptr() == batch[i * (6 // m)].data_ptr() for i, p in enumerate(parts))  # views


def test_refuses_rows_that_do_not_split() -> None:
    with pytest.raises(ValueError, match=r"targets of shape \(6, 4\) do not split into 4 equal microbatches"):
        split_microbatches(torch.zeros(6, 4), 4, "targets")
    with pytest.raises(ValueError, match=r"batch of shape \(\) do not split into 2"):
        split_microbatches(torch.tensor(1.0), 2)
