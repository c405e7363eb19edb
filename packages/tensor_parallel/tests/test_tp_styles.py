"""Tier 0: typed styles. Shard specs invert (property-tested; the KV-head spec of grouped-query
attention too, whose copies over more ranks than heads are equal, and the fused q|k|v spec of
parts of whole heads, each rank holding [q_r | k_r | v_r]), ``parallelize`` records the spec
of every parameter it splits and each rank's parameters are exactly ``spec.shard`` of the
serial ones, and a style registered from outside Tessera works in a plan."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tessera.comm import Mesh, Topology
from tessera.comm.testing import run_threaded
from tessera.models import GPT, GPTConfig
from tessera.tensor_parallel import (
    GPT_PLAN,
    ApplyContext,
    HeadShardSpec,
    PlanLike,
    Role,
    ShardSpec,
    Style,
    parallelize,
    register_style,
    resolve_plan,
    shard_specs,
    style_named,
)
from tessera.tensor_parallel.heads import FusedHeadShardSpec, fused_head_indices
from tessera.tensor_parallel.layer_styles import Colwise
from tessera.tensor_parallel.partition import fused_shard_indices


@settings(max_examples=80)
@given(
    st.integers(1, 4),  # tp
    st.integers(1, 3),  # sections
    st.lists(st.integers(1, 3), min_size=1, max_size=3),  # shape, in units
    st.data(),
)
def test_unshard_inverts_shard(tp: int, sections: int, units: list[int], data: st.DataObject) -> None:
    transposed = len(units) == 2 and data.draw(st.booleans())
    dim = data.draw(st.integers(0, len(units) - 1))
    shape = [u * (tp * sections if d == dim else 1) for d, u in enumerate(units)]
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    spec = ShardSpec(dim, sections, transposed=transposed)
    shards = [spec.shard(full, r, tp) for r in range(tp)]
    assert all(s.shape[spec.local_dim] * tp == full.shape[dim] for s in shards)
    assert torch.equal(spec.unshard(shards), full)
    # the same rows the parallel layers take (``fused_shard_indices``)
    index = torch.tensor(fused_shard_indices(shape[dim], sections, tp, tp - 1))
    last = shards[-1].t() if transposed else shards[-1]
    assert torch.equal(last, full.index_select(dim, index))


@settings(max_examples=80)
@given(
    st.sampled_from([1, 2, 4, 8]),  # tp
    st.sampled_from([1, 2, 4, 8]),  # KV heads
    st.integers(1, 3),  # rows per head
    st.integers(1, 3),  # columns
    st.booleans(),  # transposed (HF Conv1D)
)
def test_head_spec_splits_or_replicates_whole_heads(
    tp: int, heads: int, per: int, cols: int, t: bool
) -> None:
    full = torch.arange(heads * per * cols).reshape(heads * per, cols)
    spec = HeadShardSpec(0, transposed=t, heads=heads)
    shards = [spec.shard(full, r, tp) for r in range(tp)]
    assert torch.equal(spec.unshard(shards), full)
    rows = [s.t() if t else s for s in shards]
    for r, part in enumerate(rows):
        # rank r holds whole heads: the one its query heads read, or heads/tp of them
        first = r * heads // tp if tp >= heads else r * (heads // tp)
        count = max(1, heads // tp)
        assert torch.equal(part, full[first * per : (first + count) * per])
    assert spec.replicas(tp) == max(1, tp // heads)


def test_head_spec_refuses_heads_that_neither_split_nor_replicate() -> None:
    with pytest.raises(ValueError, match=r"3 blocks .* tp=2"):
        HeadShardSpec(0, heads=3).shard(torch.zeros(6, 2), 0, 2)
    with pytest.raises(ValueError, match="invalid"):
        HeadShardSpec(0, 3, heads=2)


@settings(max_examples=80)
@given(
    st.sampled_from([1, 2, 4]),  # tp
    st.sampled_from([(4, 4), (4, 2), (4, 1), (8, 2), (2, 1), (8, 8), (2, 2)]),  # (query heads, KV heads)
    st.integers(1, 3),  # head width
    st.integers(1, 3),  # columns
    st.booleans(),  # transposed (HF Conv1D)
)
def test_fused_head_spec_holds_q_k_v_of_whole_heads(
    tp: int, layout: tuple[int, int], width: int, cols: int, t: bool
) -> None:
    heads, kv = layout
    assume(heads % tp == 0 and (kv % tp == 0 or tp % kv == 0))
    rows = torch.arange((heads + 2 * kv) * width * cols).reshape(-1, cols)  # nn.Linear layout (out, in)
    spec = FusedHeadShardSpec(1 if t else 0, transposed=t, parts=(heads, kv, kv))
    full = rows.t() if t else rows
    shards = [spec.shard(full, r, tp) for r in range(tp)]
    assert torch.equal(spec.unshard(shards), full)
    q, k, v = rows.split([heads * width, kv * width, kv * width])
    for r, part in enumerate(shards):  # stored in nn.Linear layout either way
        # [q_r | k_r | v_r]: its query heads, and the KV heads they read (split, or one copied)
        want = torch.cat(
            [ShardSpec(0).shard(q, r, tp), *(HeadShardSpec(0, heads=kv).shard(x, r, tp) for x in (k, v))]
        )
        assert torch.equal(part, want)
        index = fused_head_indices(rows.shape[0], (heads, kv, kv), tp, r)  # the rows the layer takes
        assert torch.equal(part, rows.index_select(0, torch.tensor(index)))
    if kv >= tp:
        assert spec.replicas(tp) == 1
    else:
        with pytest.raises(ValueError, match=rf"held by \[1, {tp // kv}\] ranks each .* use tp <= kv_heads"):
            spec.replicas(tp)


def test_fused_sections_are_refused_naming_the_sections_and_tp() -> None:
    where = "attn.qkv (colwise_qkv): "
    with pytest.raises(
        ValueError, match=re.escape(where + "out_features=64 is not 3 equal fused sections (a q|k|v")
    ):
        Style.COLWISE_QKV.check(nn.Linear(8, 64), name="attn.qkv", tp=2)
    with pytest.raises(
        ValueError,
        match=re.escape(where + "out_features/3=6 (each of the 3 fused sections) is not divisible by tp=4"),
    ):
        Style.COLWISE_QKV.check(nn.Linear(8, 18), name="attn.qkv", tp=4)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "mlp.gate_up (colwise_gate_up): out_features/2=6 (each of the 2 fused sections) is not "
        ),
    ):
        Style.COLWISE_GATE_UP.check(nn.Linear(8, 12), name="mlp.gate_up", tp=4)
    with pytest.raises(
        ValueError, match=re.escape("x: out_features=64 is not divisible by sections (fused parts)=3")
    ):
        fused_shard_indices(64, 3, 2, 0, what="out_features", where="x")
    with pytest.raises(
        ValueError, match=r"attn.qkv \(colwise_qkv_heads\): the heads of its fused q\|k\|v parts are told"
    ):
        Style.COLWISE_QKV_HEADS.check(nn.Linear(8, 24), name="attn.qkv", tp=2)
    assert FusedHeadShardSpec(0, parts=(1, 1)).replicas(2) == 2  # every part copied: one count
    with pytest.raises(ValueError, match="invalid"):
        FusedHeadShardSpec(0, parts=())


class FusedAttention(nn.Module):
    """Shapes only: a fused q|k|v of ``kv`` KV heads of 4 query heads, head width 2."""

    def __init__(self, kv: int, width: int | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = 4, kv, 2
        self.qkv = nn.Linear(8, width or (4 + 2 * kv) * 2)
        self.o = nn.Linear(8, 8)


@pytest.mark.parametrize(
    ("kv", "style", "parts"),
    [(2, "colwise_qkv", (4, 2, 2)), (2, "colwise_qkv_heads", (4, 2, 2)), (1, "colwise_qkv", (4, 1, 1)),
     (4, "colwise_qkv", None), (4, "colwise_qkv_heads", (4, 4, 4))],
)  # fmt: skip
def test_attention_splits_a_fused_qkv_by_its_heads(
    kv: int, style: str, parts: tuple[int, ...] | None
) -> None:
    plan = {"attn": "attention", "attn.qkv": style, "attn.o": "rowwise"}
    got = {a.name: a.style for a in resolve_plan(nn.ModuleDict({"attn": FusedAttention(kv)}), plan, tp=2)}
    qkv = got["attn.qkv"]
    assert isinstance(qkv, Colwise) and qkv.name == style and qkv.parts == parts
    with pytest.raises(
        ValueError, match=re.escape("attn.qkv (colwise_qkv): a fused q|k|v projection of 20 output")
    ):
        resolve_plan(
            nn.ModuleDict({"attn": FusedAttention(2, width=20)}), {**plan, "attn.qkv": "colwise_qkv"}, tp=2
        )


def test_invalid_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="invalid"):
        ShardSpec(2, transposed=True)
    with pytest.raises(ValueError, match="invalid"):
        ShardSpec(0, 0)


class Conv1D(nn.Module):
    """HF's Conv1D layout (``is_dense`` knows it by name): y = x @ weight + bias, weight (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(8, 6)
        self.qkv = Conv1D(12, 6)  # fused q|k|v, 4 wide each
        self.proj = Conv1D(6, 4)
        self.fc = nn.Linear(6, 4)
        self.out = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)


TINY_PLAN = {
    "tok": "vocab",
    "qkv": "colwise_qkv",
    "proj": "rowwise",
    "fc": "colwise",
    "out": "rowwise",
    "norm": "sequence_norm",
}


Shards = tuple[dict[str, Tensor], dict[str, ShardSpec]]


def _shards(rank: int, build: Callable[[], nn.Module], serial: dict[str, Tensor], plan: PlanLike) -> Shards:
    model = build()
    model.load_state_dict(serial)
    parallelize(model, plan=plan, mesh=Mesh(Topology(tp=2)))
    specs = shard_specs(model)
    for name, p in model.named_parameters():
        spec = specs.get(name)
        expected = serial[name] if spec is None else spec.shard(serial[name], rank, 2)
        assert torch.equal(p.detach(), expected), name
    return {name: p.detach().clone() for name, p in model.named_parameters()}, dict(specs)


@pytest.mark.parametrize("which", ["tiny", "gpt"])
def test_parallelize_records_how_every_parameter_was_split(which: str) -> None:
    torch.manual_seed(0)
    plan: PlanLike = TINY_PLAN if which == "tiny" else GPT_PLAN

    def build() -> nn.Module:
        return Tiny() if which == "tiny" else GPT(GPTConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=1))

    serial = {k: v.clone() for k, v in build().state_dict().items()}
    (params0, specs), (params1, specs1) = run_threaded(2, _shards, build, serial, plan)
    assert specs == specs1 and specs
    for name, spec in specs.items():
        assert torch.equal(spec.unshard([params0[name], params1[name]]), serial[name]), name
    if which == "tiny":
        assert set(specs) == {
            "tok.weight",
            "qkv.weight",
            "qkv.bias",
            "proj.weight",
            "fc.weight",
            "fc.bias",
            "out.weight",
        }
        assert specs["qkv.weight"] == ShardSpec(1, 3, transposed=True)
        assert specs["qkv.bias"] == ShardSpec(0, 3)
        assert specs["proj.weight"] == ShardSpec(0, transposed=True)
        assert specs["out.weight"] == ShardSpec(1)


@dataclass(frozen=True)
class Replicate:
    """A style from outside Tessera: the Linear stays whole on every rank, marked with tp."""

    name: str = "test_replicate"
    role: Role = Role.LOCAL

    def check(self, module: nn.Module, *, name: str, tp: int) -> None:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{name} ({self.name}): expected nn.Linear, got {type(module).__name__}")

    def apply(self, module: nn.Module, ctx: ApplyContext) -> nn.Module | None:
        setattr(module, "replicated_over", ctx.tp)  # noqa: B010 (nn.Module types attributes as Tensor | Module)
        return None

    def shard_spec(self, module: nn.Module, param: str) -> ShardSpec | None:
        return None


REPLICATE = register_style(Replicate())


def _replicated(rank: int) -> tuple[str, int, list[str]]:
    model = Tiny()
    parallelize(model, plan={"fc": "test_replicate", "out": Style.ROWWISE}, mesh=Mesh(Topology(tp=2)))
    return type(model.fc).__name__, int(getattr(model.fc, "replicated_over", 0)), sorted(shard_specs(model))


def test_a_registered_style_is_used_by_name_in_a_plan() -> None:
    assert style_named("test_replicate") is REPLICATE and style_named("colwise") is Style.COLWISE
    for kind, tp, specs in run_threaded(2, _replicated):
        assert (kind, tp, specs) == ("Linear", 2, ["out.weight"])
    with pytest.raises(ValueError, match=r"tok \(test_replicate\): expected nn.Linear, got Embedding"):
        resolve_plan(Tiny(), {"tok": "test_replicate"}, tp=2)


def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="a style named 'colwise' is already registered"):
        register_style(Colwise("colwise"))
    register_style(REPLICATE)  # the same object again is fine
    with pytest.raises(TypeError, match="does not meet the TPStyle protocol"):
        register_style(object())  # type: ignore[arg-type]
