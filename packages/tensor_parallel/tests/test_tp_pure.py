"""Tier 0: shard arithmetic, plan matching and validation, seeded initialisation, RNG streams.

Nothing here starts a rank; the one test that calls ``parallelize`` with a bad plan does so
on threaded ranks inside a CommMeter to show that the error comes before any communication.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tessera.comm import CommMeter, Mesh, Topology
from tessera.comm.testing import run_threaded
from tessera.models import GPT, GPTConfig
from tessera.tensor_parallel import (
    GPT_PLAN,
    DropoutRNG,
    Plan,
    RNGRegion,
    Style,
    parallelize,
    resolve_plan,
    seeded_embedding,
    seeded_linear,
)
from tessera.tensor_parallel.partition import fused_shard_indices, shard_range
from tessera.tensor_parallel.plan import match_pattern


@settings(max_examples=60)
@given(st.integers(1, 8), st.integers(1, 16), st.integers(1, 3))
def test_shards_partition_the_dimension(n: int, per: int, sections: int) -> None:
    size = n * per
    ranges = [shard_range(size, n, r) for r in range(n)]
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    fused = [fused_shard_indices(size * sections, sections, n, r) for r in range(n)]
    assert sorted(i for f in fused for i in f) == list(range(size * sections))
    # every rank holds the same slice of each fused part, so its parts stay aligned
    for r, f in enumerate(fused):
        lo, hi = ranges[r]
        assert f == [s * size + i for s in range(sections) for i in range(lo, hi)]


def test_shard_errors_name_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"lm_head: out_features=30 is not divisible by tp=4"):
        shard_range(30, 4, 0, what="out_features", where="lm_head")
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        shard_range(4, 2, 2)


@settings(max_examples=60)
@given(st.lists(st.sampled_from(["a", "b", "0", "1", "attn"]), min_size=1, max_size=4), st.data())
def test_patterns_match_component_by_component(name: list[str], data: st.DataObject) -> None:
    dotted = ".".join(name)
    stars = [data.draw(st.booleans()) for _ in name]
    pattern = ".".join("*" if s else part for s, part in zip(stars, name, strict=True))
    assert match_pattern(pattern, dotted)
    assert not match_pattern(pattern + ".x", dotted)  # a star never spans a dot
    assert not match_pattern("*." + pattern, dotted)


def test_gpt_plan_resolves_with_one_entry_per_region() -> None:
    model = GPT(GPTConfig(n_layers=2))
    got = {a.name: a for a in resolve_plan(model, GPT_PLAN, tp=4, sequence_parallel=True)}
    assert got["layers.1.attn"].style is Style.ATTENTION
    assert got["layers.0.attn.q_proj"].style is Style.COLWISE
    assert not got["layers.0.attn.q_proj"].enter_region  # the attention module enters once
    assert not got["layers.1.mlp.fc_in"].enter_region
    assert got["head.lm_head"].enter_region  # a standalone colwise layer enters itself
    assert len(got) == 3 + 2 * 12 + 2


CFG = GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=1)
MLP_ONLY = {"layers.*.mlp": "region", "layers.*.mlp.fc_in": "colwise", "layers.*.mlp.fc_out": "rowwise"}


@pytest.mark.parametrize(
    ("cfg", "plan", "tp", "message"),
    [
        (CFG, GPT_PLAN, 8, "layers.0.attn (attention): heads=4 is not divisible by tp=8"),
        (
            GPTConfig(d_model=30, n_heads=3, n_layers=1, mlp_ratio=1),
            MLP_ONLY,
            4,
            "layers.0.mlp.fc_in (colwise): out_features=30 is not divisible by tp=4",
        ),
        (
            GPTConfig(vocab_size=30, n_layers=1),
            GPT_PLAN,
            4,
            "embed.tok (vocab): num_embeddings (vocab)=30 is not divisible by tp=4",
        ),
        (
            CFG,
            {**GPT_PLAN.as_dict(), "layers.*.attn.qproj": "colwise"},
            2,
            "plan entry 'layers.*.attn.qproj' (colwise) matches no module",
        ),
        (
            CFG,
            {**GPT_PLAN.as_dict(), "layers.*.attn.*_proj": "rowwise"},
            2,
            "conflicting plan entries for module 'layers.0.attn.q_proj': 'layers.*.attn.q_proj' -> colwise "
            "and 'layers.*.attn.*_proj' -> rowwise",
        ),
        (
            CFG,
            {**GPT_PLAN.as_dict(), "layers.*": "region"},
            2,
            "conflicting plan entries: region 'layers.0.attn' (attention) lies inside region 'layers.0'",
        ),
        (
            CFG,
            {"embed": "vocab"},
            2,
            "embed (vocab): expected torch.nn.Embedding, got Embedding (from tessera.models.gpt)",
        ),
        (CFG, {"layers.0.attn": "region"}, 2, "a region needs colwise and rowwise layers inside it"),
        (CFG, {"head.lm_head": "sideways"}, 2, "plan entry 'head.lm_head': unknown style 'sideways'"),
    ],
)
def test_bad_plans_are_value_errors_naming_module_and_numbers(
    cfg: GPTConfig, plan: dict[str, str] | Plan, tp: int, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_plan(GPT(cfg), plan, tp=tp)


def test_an_optional_entry_may_match_nothing_and_only_it() -> None:
    """A module some configurations of a family do not build: its entry is optional, so the
    plan resolves without it; the same entry, not optional, is an error; and an optional
    pattern that is no entry of the plan is refused as the plan is made."""
    extra = {**GPT_PLAN.as_dict(), "layers.*.shared_mlp": "replicate"}
    plan = Plan.of(extra, name="maybe", optional=["layers.*.shared_mlp"])
    want = [(a.name, a.style) for a in resolve_plan(GPT(CFG), GPT_PLAN, tp=2)]
    assert [(a.name, a.style) for a in resolve_plan(GPT(CFG), plan, tp=2)] == want
    with pytest.raises(
        ValueError, match=re.escape("plan entry 'layers.*.shared_mlp' (replicate) matches no")
    ):
        resolve_plan(GPT(CFG), Plan.of(extra), tp=2)
    with pytest.raises(
        ValueError, match=re.escape("plan 'maybe': optional patterns ['layers.*.mlp2'] are not")
    ):
        Plan.of(extra, name="maybe", optional=["layers.*.mlp2"])


def test_sequence_parallel_is_refused_for_a_plan_that_cannot_run_it() -> None:
    plan = Plan.of({"lin": "colwise"}, name="no-sp", supports_sequence_parallel=False)
    with pytest.raises(ValueError, match="plan 'no-sp' does not support sequence parallelism"):
        resolve_plan(nn.Linear(2, 2), plan, tp=2, sequence_parallel=True)


def test_untied_split_of_a_tied_weight_is_refused() -> None:
    model = GPT(CFG)
    model.head.lm_head.weight = model.embed.tok.weight  # tie, then split only one side

    def rank(_: int) -> tuple[str, int]:
        with CommMeter() as meter, pytest.raises(ValueError) as err:
            parallelize(model, plan={"embed.tok": "vocab"}, mesh=Mesh(Topology(tp=2)))
        return str(err.value), meter.count()

    message, calls = run_threaded(2, rank)[0]
    assert "embed.tok.weight (split dim0)" in message and "head.lm_head.weight (kept whole)" in message
    assert calls == 0


def _bad_parallelize(rank: int, cfg: GPTConfig, tp: int) -> tuple[str, int, bool]:
    model = GPT(cfg, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CommMeter() as meter, pytest.raises(ValueError) as err:
        parallelize(model, plan=GPT_PLAN, mesh=Mesh(Topology(tp=tp)))
    same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return str(err.value), meter.count(), same and type(model.embed.tok) is nn.Embedding


def test_parallelize_fails_before_any_communication_and_changes_nothing() -> None:
    cfg = GPTConfig(vocab_size=64, d_model=48, n_heads=6, n_layers=1)  # 6 heads over tp=4
    for message, calls, unchanged in run_threaded(4, _bad_parallelize, cfg, 4):
        assert message == "layers.0.attn (attention): heads=6 is not divisible by tp=4"
        assert calls == 0 and unchanged


@pytest.mark.parametrize("bias", [True, False])
def test_seeded_layers_are_what_the_global_seed_gives(bias: bool) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        linear = nn.Linear(7, 5, bias=bias)
        torch.manual_seed(12)
        embedding = nn.Embedding(9, 4, padding_idx=2)
    twin = seeded_linear(7, 5, bias=bias, seed=11)
    assert torch.equal(twin.weight, linear.weight)
    assert (twin.bias is None) == (linear.bias is None)
    if bias:
        assert twin.bias is not None and linear.bias is not None and torch.equal(twin.bias, linear.bias)
    assert torch.equal(seeded_embedding(9, 4, seed=12, padding_idx=2).weight, embedding.weight)


def test_dropout_streams_replicated_equal_split_differ_and_fork_restores() -> None:
    a, b = DropoutRNG(5, tp_rank=0), DropoutRNG(5, tp_rank=1)
    rep = [torch.rand(8, generator=r.generator(RNGRegion.REPLICATED)) for r in (a, b)]
    split = [torch.rand(8, generator=r.generator(RNGRegion.SPLIT)) for r in (a, b)]
    assert torch.equal(rep[0], rep[1])
    assert not torch.equal(split[0], split[1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        state = torch.get_rng_state()
        with a.fork("split"):
            first = torch.rand(4)
        with a.fork("split"):
            second = torch.rand(4)  # the stream continues where it stopped
        assert torch.equal(torch.get_rng_state(), state)
    expected = DropoutRNG(5, tp_rank=0).generator("split")
    torch.rand(8, generator=expected)  # the draw made above through a.generator
    assert torch.equal(torch.cat([first, second]), torch.rand(8, generator=expected))


def _unplanned(rank: int) -> list[str]:
    model = GPT(GPTConfig(n_layers=1, dropout=0.1))
    plan = {p: s for p, s in GPT_PLAN.entries if s is not Style.DROPOUT}
    parallelize(model, plan=plan, mesh=Mesh(Topology(tp=2)))
    return [type(m).__name__ for m in model.modules() if isinstance(m, nn.Dropout)]


def test_dropouts_the_plan_leaves_out_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="tessera.tensor_parallel"):
        kept = run_threaded(2, _unplanned)[0]
    assert kept == ["Dropout"] * 3  # embed.drop, attn.resid_drop, mlp.drop stay plain
    warned = {r.getMessage().split()[1] for r in caplog.records if "does not cover" in r.getMessage()}
    assert warned == {"embed.drop", "layers.0.attn.resid_drop", "layers.0.mlp.drop"}
