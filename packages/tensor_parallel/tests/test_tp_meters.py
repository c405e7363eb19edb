"""Tier 1: bytes moved and activation bytes held by one parallel transformer layer, per rank,
measured by tessera.comm's meters against Megatron's formulas.

Communication (per layer, per micro-batch; b batch, s sequence, h hidden, e element bytes).
The meter counts an all-reduce of S bytes as 2S (a reduce-scatter then an all-gather), an
all-gather as its output S, a reduce-scatter as its input S. Megatron 1D TP moves two
all-reduces of b*s*h forward (attention and MLP outputs, g) and two backward (their input
gradients, f): 2 * 2bshe = 4bshe each way. With sequence parallelism each all-reduce becomes
an all-gather + a reduce-scatter of b*s*h: the same 4bshe each way.

Activations saved for backward (storage bytes per rank, parameters excluded, dropout 0):
LayerNorm inputs and statistics, (2 + 4/h) bshe, are the only ones that live in the
sequence region, so sequence parallelism divides exactly them by tp; the rest of the layer
(the all-gathered inputs of the q/k/v and fc_in layers, 2 bshe, kept whole; q, k, v and the
attention output, 4/t; the attention log-sum-exp, a/(t h); the MLP's hidden and GELU
outputs, 2r/t) is the same with and without SP.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from tessera.comm import CommMeter, CommOp, Mesh, Topology, storage_bytes
from tessera.comm.testing import run_threaded
from tessera.models import GPT, GPTConfig
from tessera.tensor_parallel import GPT_PLAN, Plan, parallelize

BLOCK_PLAN = Plan.of(
    {p.removeprefix("layers.*."): s for p, s in GPT_PLAN.entries if p.startswith("layers.*.")}, name="block"
)


@st.composite
def layer_case(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.sampled_from([2, 4]))
    heads = n * draw(st.integers(1, 2))
    return {
        "n": n,
        "b": draw(st.integers(1, 3)),
        "s": n * draw(st.integers(1, 4)),
        "h": heads * draw(st.sampled_from([2, 4, 8])),
        "heads": heads,
        "r": draw(st.integers(1, 4)),
        "sp": draw(st.booleans()),
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
    }


def _layer(c: dict[str, Any]) -> torch.nn.Module:
    cfg = GPTConfig(seq_len=c["s"], d_model=c["h"], n_heads=c["heads"], mlp_ratio=c["r"])
    block = GPT(cfg, seed=0).layers[0].to(c["dtype"])
    return parallelize(block, plan=BLOCK_PLAN, mesh=Mesh(Topology(tp=c["n"])), sequence_parallel=c["sp"])


def _input(c: dict[str, Any]) -> Tensor:
    s = c["s"] // c["n"] if c["sp"] else c["s"]
    return torch.randn(c["b"], s, c["h"], dtype=c["dtype"], requires_grad=True)


def _comm(rank: int, c: dict[str, Any]) -> tuple[CommMeter, CommMeter]:
    block = _layer(c)
    x = _input(c)
    with CommMeter() as fwd:
        y = block(x)
    with CommMeter() as bwd:
        y.sum().backward()
    return fwd, bwd


@settings(max_examples=30)
@given(layer_case())
def test_bytes_per_layer_follow_the_megatron_formula(c: dict[str, Any]) -> None:
    e = torch.finfo(c["dtype"]).bits // 8
    bshe = c["b"] * c["s"] * c["h"] * e
    for fwd, bwd in run_threaded(c["n"], _comm, c):
        for meter in (fwd, bwd):
            assert meter.volume_bytes == 4 * bshe  # two all-reduces of bshe, counted 2x each
            if c["sp"]:  # each all-reduce became an all-gather + a reduce-scatter of bshe
                assert meter.by_op() == {CommOp.ALL_GATHER: 2 * bshe, CommOp.REDUCE_SCATTER: 2 * bshe}
                assert meter.count(CommOp.ALL_GATHER) == meter.count(CommOp.REDUCE_SCATTER) == 2
            else:
                assert meter.by_op() == {CommOp.ALL_REDUCE: 4 * bshe}
                assert meter.count() == meter.count(CommOp.ALL_REDUCE) == 2


def _saved(rank: int, c: dict[str, Any]) -> tuple[int, int]:
    """Storage bytes of the tensors autograd saves in one forward: (in LayerNorms, elsewhere)."""
    block = _layer(c)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    where = ["other"]
    for name in ("ln1", "ln2"):
        ln = block.get_submodule(name)
        ln.register_forward_pre_hook(lambda *_: where.__setitem__(0, "norm"))
        ln.register_forward_hook(lambda *_: where.__setitem__(0, "other"))
    saved: dict[str, list[Tensor]] = {"norm": [], "other": []}

    def pack(t: Tensor) -> Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[where[0]].append(t)
        return t

    x = _input(c)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return storage_bytes(saved["norm"]), storage_bytes(saved["other"])


def analytic_units(c: dict[str, Any], sp: bool) -> float:
    """Saved bytes of one layer per rank in units of b*s*h*e (see the module docstring)."""
    t, h, a, r = c["n"], c["h"], c["heads"], c["r"]
    norm = (2 + 4 / h) / (t if sp else 1)
    return norm + 2 + (4 + 2 * r) / t + a / (t * h)


@settings(max_examples=20)
@given(layer_case())
def test_sequence_parallelism_divides_the_norm_region_activations_by_tp(c: dict[str, Any]) -> None:
    n = c["n"]
    (norm_tp, other_tp), *_ = run_threaded(n, _saved, {**c, "sp": False})
    (norm_sp, other_sp), *_ = run_threaded(n, _saved, {**c, "sp": True})
    assert norm_sp * n == norm_tp  # LayerNorm inputs and statistics: exactly 1/tp
    assert other_sp == other_tp  # nothing else changes
    bshe = c["b"] * c["s"] * c["h"] * (torch.finfo(c["dtype"]).bits // 8)
    # fp32: the count is exact. bf16: LayerNorm statistics and the log-sum-exp stay fp32,
    # twice their share in bf16 units; a 5% band covers that.
    band = 1e-9 if c["dtype"] == torch.float32 else 0.05
    for sp, total in ((False, norm_tp + other_tp), (True, norm_sp + other_sp)):
        assert abs(total / bshe - analytic_units(c, sp)) <= band * analytic_units(c, sp), (sp, total / bshe)
    measured = (norm_sp + other_sp) / (norm_tp + other_tp)
    analytic = analytic_units(c, sp=True) / analytic_units(c, sp=False)
    assert abs(measured - analytic) <= band * analytic, (measured, analytic)
