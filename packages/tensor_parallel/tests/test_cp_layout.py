"""Tier 0: which positions each rank holds under context parallelism (pure functions).

Exact comparisons only: these are integer positions and slices of tensors, no arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tessera.tensor_parallel.context import (
    Layout,
    check_ulysses,
    chunks_of,
    local_positions,
    rank_positions,
    sequence_chunks,
    split_sequence,
    unsplit_sequence,
)

LAYOUTS = st.sampled_from(list(Layout))


@st.composite
def cuts(draw: st.DrawFn) -> tuple[int, int, Layout]:
    """(cp, seq_len, layout) with seq_len cut evenly by the layout's chunk count."""
    cp, layout = draw(st.integers(1, 8)), draw(LAYOUTS)
    return cp, sequence_chunks(cp, layout) * draw(st.integers(1, 6)), layout


@given(st.integers(1, 6), LAYOUTS, st.integers(1, 4), st.booleans())
def test_sequence_chunks_is_the_cut_every_rank_and_tp_slice_needs(
    cp: int, layout: Layout, tp: int, sequence_parallel: bool
) -> None:
    """A length cuts evenly (every rank's chunks, and with sequence parallelism their tp
    slices, equal) exactly when it is a multiple of ``sequence_chunks``."""
    n = sequence_chunks(cp, layout, tp=tp, sequence_parallel=sequence_parallel)
    slices = tp if sequence_parallel else 1  # Megatron SP cuts each rank's part again over tp
    for seq_len in range(1, 2 * n + 2):
        cut_evenly = True
        try:
            parts = [split_sequence(torch.arange(seq_len)[None], r, cp, layout) for r in range(cp)]
        except ValueError:
            cut_evenly = False
        else:
            pieces = [len(chunks_of(r, cp, layout)) * slices for r in range(cp)]
            cut_evenly = all(p.shape[1] % m == 0 for p, m in zip(parts, pieces, strict=True))
        assert cut_evenly == (seq_len % n == 0)


def test_sequence_chunks_names_bad_degrees() -> None:
    with pytest.raises(ValueError, match="cp=0, tp=1"):
        sequence_chunks(0, "zigzag")
    with pytest.raises(ValueError, match="cp=2, tp=0"):
        sequence_chunks(2, tp=0, sequence_parallel=True)
    with pytest.raises(ValueError, match="'diagonal' is not a valid Layout"):
        sequence_chunks(2, "diagonal")


@given(cuts())
def test_positions_partition_the_sequence(cut: tuple[int, int, Layout]) -> None:
    cp, seq_len, layout = cut
    held = [rank_positions(r, cp, seq_len, layout) for r in range(cp)]
    assert sorted(p for ps in held for p in ps) == list(range(seq_len))
    assert {len(ps) for ps in held} == {seq_len // cp}
    for r, ps in enumerate(held):
        assert local_positions(r, cp, seq_len // cp, layout).tolist() == ps


@given(cuts())
def test_zigzag_balances_causal_work(cut: tuple[int, int, Layout]) -> None:
    """Under zigzag every rank's queries attend to the same number of keys (causal pairs)."""
    cp, seq_len, layout = cut
    work = [sum(p + 1 for p in rank_positions(r, cp, seq_len, layout)) for r in range(cp)]
    if layout is Layout.ZIGZAG:
        assert len(set(work)) == 1
        assert all(chunks_of(r, cp, layout) == (r, 2 * cp - 1 - r) for r in range(cp))
    else:
        assert work == sorted(work)


@given(cuts(), st.integers(0, 2), st.integers(1, 3))
def test_split_and_unsplit_are_inverse(cut: tuple[int, int, Layout], dim: int, width: int) -> None:
    cp, seq_len, layout = cut
    shape = [width, width, width]
    shape[dim] = seq_len
    x = torch.arange(width * width * seq_len).reshape(shape)
    parts = [split_sequence(x, r, cp, layout, dim) for r in range(cp)]
    for r, part in enumerate(parts):
        index = torch.tensor(rank_positions(r, cp, seq_len, layout))
        assert torch.equal(part, x.index_select(dim, index))
    assert torch.equal(unsplit_sequence(parts, layout, dim), x)


def test_errors_name_the_numbers() -> None:
    with pytest.raises(
        ValueError, match=r"sequence length 6 is not divisible by 4 chunks \(zigzag layout, cp=2\)"
    ):
        rank_positions(0, 2, 6, "zigzag")
    with pytest.raises(ValueError, match="rank 2 is outside the context-parallel group of 2 ranks"):
        chunks_of(2, 2, Layout.CONTIGUOUS)
    with pytest.raises(ValueError, match="heads=6 and kv heads=2 divisible by cp=4"):
        check_ulysses(6, 2, 4)
    with pytest.raises(ValueError, match="'diagonal' is not a valid Layout"):
        rank_positions(0, 2, 4, "diagonal")
