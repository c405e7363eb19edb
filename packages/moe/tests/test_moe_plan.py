"""Tier 0: the dispatch plan (capacity and deterministic dropping) as properties, against a
token-by-token reference that fills each expert's slots in token order."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.moe import capacity, plan_dispatch


@st.composite
def choices(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    """``[T, k]`` distinct experts per token, some experts possibly never chosen."""
    experts = draw(st.integers(1, 8))
    k = draw(st.integers(1, experts))
    tokens = draw(st.integers(0, 12))
    rows = [draw(st.permutations(range(experts)))[:k] for _ in range(tokens)]
    return torch.tensor(rows, dtype=torch.long).reshape(tokens, k), experts


def reference(choices: torch.Tensor, experts: int, cap: int | None) -> list[list[int]]:
    """Per expert, the assignments (``t * k + j``) it keeps, filling slots in token order."""
    kept: list[list[int]] = [[] for _ in range(experts)]
    k = choices.shape[1]
    for t in range(choices.shape[0]):
        for j in range(k):
            e = int(choices[t, j])
            if cap is None or len(kept[e]) < cap:
                kept[e].append(t * k + j)
    return kept


@settings(max_examples=200)
@given(choices(), st.one_of(st.none(), st.integers(0, 6)))
def test_plan_keeps_the_first_assignments_of_each_expert_in_token_order(
    c: tuple[torch.Tensor, int], cap: int | None
) -> None:
    ch, experts = c
    plan = plan_dispatch(ch, experts, cap)
    want = reference(ch, experts, cap)
    assert plan.assignment.tolist() == [a for per_expert in want for a in per_expert]
    assert plan.expert.tolist() == [e for e, per_expert in enumerate(want) for _ in per_expert]
    assert plan.token.tolist() == [a // ch.shape[1] for a in plan.assignment.tolist()]
    assert plan.kept.tolist() == [len(per_expert) for per_expert in want]
    routed = torch.bincount(ch.reshape(-1), minlength=experts)
    assert torch.equal(plan.routed, routed)
    assert plan.dropped == int(routed.sum()) - sum(len(p) for p in want)
    if cap is None:
        assert plan.dropped == 0


@settings(max_examples=200)
@given(st.integers(0, 1000), st.integers(1, 64), st.integers(1, 8), st.floats(0.01, 8.0))
def test_capacity_is_the_ceiling_of_the_factor_times_the_even_share(
    tokens: int, experts: int, k: int, factor: float
) -> None:
    cap = capacity(tokens, experts, k, factor)
    assert cap == math.ceil(factor * tokens * k / experts)
    assert capacity(tokens, experts, k, None) is None


@pytest.mark.parametrize("factor", [0.0, -1.0, float("nan")])
def test_capacity_refuses_a_factor_that_is_not_positive(factor: float) -> None:
    with pytest.raises(
        ValueError, match=rf"capacity_factor must be > 0 \(or None for drop-less\), got {factor}"
    ):
        capacity(4, 2, 1, factor)


def test_plan_refuses_an_expert_out_of_range() -> None:
    with pytest.raises(ValueError, match="choices name expert 3, but there are only 3"):
        plan_dispatch(torch.tensor([[0], [3]]), 3, None)
