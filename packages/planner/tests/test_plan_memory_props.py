"""Tier 0: the invariants of the planner's memory model, against the papers it follows and
against itself as the parallel degrees grow.

- `model_state_bytes` is the ZeRO paper's table (Rajbhandari et al. 2020, Fig. 1: mixed
  precision Adam holds 16 bytes per parameter unsharded, ``4 + 12/N`` at stage 1, ``2 + 14/N``
  at stage 2, ``16/N`` at stage 3) plus Adam's 4-byte step counter per flat buffer; more ranks
  never hold more; a higher stage never holds more on the device (except stage 3 inside
  ``accumulating()``, which the docstring says keeps its shard beside the full parameters);
  offload only moves bytes to the host.
- `activation_bytes` is Korthikanti et al. (2022)'s ``s b h (10 + 24 / t)`` per layer in fp16
  with dropout (``34 s b h / t`` with sequence parallelism, ``2 s b h`` with full
  recomputation); recomputation, sequence, tensor and context parallelism never raise it.
- `ModelShape.block_params` is GPT-2's count (``12 d^2 + 13 d`` a layer); tensor parallelism
  never gives a rank more, and covers the model.

`estimate`'s fullest rank as the degrees grow: ``test_plan_memory_ranks.py``.

Comparisons are exact (``==`` or ``<=`` on the same float operations) except where a sum is
re-associated, which is stated (rel 1e-12: a few roundings of doubles). Pure (no processes).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tessera.planner import ModelShape, TPShape
from tessera.planner.memory import (
    DTYPE_BYTES,
    OPTIMIZER_BYTES,
    ActivationShape,
    activation_bytes,
    model_state_bytes,
    optimizer_bytes,
)

PRECISIONS = sorted(DTYPE_BYTES)
OPTIMIZERS = sorted(OPTIMIZER_BYTES)
REL = 1e-12  # a re-associated sum of a few doubles


def _device(parts: tuple[float, float, float, float]) -> float:
    params, grads, state, host = parts
    return params + grads + state - host


state_args = {
    "psi": st.integers(0, 10**9),
    "stage": st.integers(0, 3),
    "precision": st.sampled_from(PRECISIONS),
    "offload": st.booleans(),
    "optimizer": st.sampled_from(OPTIMIZERS),
    "flats": st.integers(1, 64),
    "one_reduction": st.booleans(),
}


# ------------------------------------------------------------------ model state
@pytest.mark.parametrize("n", [1, 8, 64])
def test_mixed_precision_adam_is_the_zero_papers_table(n: int) -> None:
    """Rajbhandari et al. (2020), Fig. 1, K = 12 (fp32 master, momentum, variance): bytes per
    parameter 2 + 2 + 12 at stage 0, 2 + 2 + 12/N at stage 1, 2 + (2 + 12)/N at stage 2,
    (2 + 2 + 12)/N at stage 3; plus 4 bytes of Adam's step counter for the one flat buffer.
    Exact: psi is a multiple of n, so every term is an exact float."""
    psi = 2**20 * n
    per_param = {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}
    for stage, want in per_param.items():
        got = model_state_bytes(psi, stage=stage, n=n, precision="bf16", offload=False)
        assert sum(got[:3]) == want * psi + 4 and got[3] == 0.0


@settings(max_examples=200, deadline=None)
@given(**state_args, n=st.integers(1, 512), more=st.integers(1, 512))
def test_more_ranks_never_hold_more_of_any_part(
    psi: int,
    stage: int,
    precision: str,
    offload: bool,
    optimizer: str,
    flats: int,
    one_reduction: bool,
    n: int,
    more: int,
) -> None:
    """Sharding over ``n + more`` ranks: parameters, gradients, optimizer state and the host's
    share each no larger than over ``n``; stage 0 (plain data parallelism) shards nothing."""
    kw = {"stage": stage, "precision": precision, "offload": offload, "optimizer": optimizer}
    kw |= {"flats": flats, "one_reduction": one_reduction}
    few = model_state_bytes(psi, n=n, **kw)  # type: ignore[arg-type]
    many = model_state_bytes(psi, n=n + more, **kw)  # type: ignore[arg-type]
    assert all(b <= a for a, b in zip(few, many, strict=True)), (few, many)
    if stage == 0:
        assert few == many


@settings(max_examples=200, deadline=None)
@given(**state_args, n=st.integers(1, 512))
def test_a_higher_stage_never_holds_more_on_the_device(
    psi: int,
    stage: int,
    precision: str,
    offload: bool,
    optimizer: str,
    flats: int,
    one_reduction: bool,
    n: int,
) -> None:
    """Stage k holds no more device bytes than stage k - 1; inside ``accumulating()`` (a
    pipeline, Megatron SP) stage 3 holds stage 2's bytes and its parameter shard ``c psi / n``
    (the docstring's "stage 3 also its parameter shard"), the one exception."""
    assume(stage > 0)
    kw = {"n": n, "precision": precision, "offload": offload, "optimizer": optimizer, "flats": flats}
    kw |= {"one_reduction": one_reduction}
    lower = _device(model_state_bytes(psi, stage=stage - 1, **kw))  # type: ignore[arg-type]
    higher = _device(model_state_bytes(psi, stage=stage, **kw))  # type: ignore[arg-type]
    if one_reduction and stage == 3:
        c = DTYPE_BYTES[precision]
        assert higher == pytest.approx(lower + c * psi / n, rel=REL)
    else:
        assert higher <= lower * (1 + REL), (lower, higher)


@settings(max_examples=200, deadline=None)
@given(**state_args, n=st.integers(1, 512))
def test_offload_moves_masters_gradient_shards_and_state_to_the_host(
    psi: int,
    stage: int,
    precision: str,
    offload: bool,
    optimizer: str,
    flats: int,
    one_reduction: bool,
    n: int,
) -> None:
    """With offload the device keeps only the compute-dtype parameters and the full gradients
    (stages 0-1, or inside ``accumulating()``) and Adam's step counters; the host holds the
    fp32 master, gradient shard and optimizer state (``(4 + K + 4) psi / n``). Offload never
    adds device bytes, and without it nothing is on the host."""
    kw = {"stage": stage, "n": n, "precision": precision, "optimizer": optimizer, "flats": flats}
    kw |= {"one_reduction": one_reduction}
    on = model_state_bytes(psi, offload=True, **kw)  # type: ignore[arg-type]
    off = model_state_bytes(psi, offload=False, **kw)  # type: ignore[arg-type]
    assert off[3] == 0.0
    c, k = DTYPE_BYTES[precision], optimizer_bytes(optimizer)
    shards = 1 if stage == 0 else n
    assert on[3] == (4 + k + 4) * psi / shards
    params = on[0]
    full_grads = c * psi if stage <= 1 or one_reduction else 0.0
    counters = 4 * flats if k == 8 else 0
    assert _device(on) == pytest.approx(params + full_grads + counters, rel=REL, abs=1e-6)
    assert _device(on) <= _device(off) * (1 + REL)
    assert on[0] == off[0]  # the compute copy of the parameters stays


def test_sgd_without_momentum_keeps_no_state_and_fp32_no_master() -> None:
    assert optimizer_bytes("sgd", momentum=0.0) == 0 and optimizer_bytes("sgd") == 4
    assert optimizer_bytes("adamw") == optimizer_bytes("adam") == 8
    params, grads, state, host = model_state_bytes(1000, stage=1, n=4, precision="fp32", offload=False)
    assert (params, grads, state, host) == (
        4000,
        4000,
        8 * 1000 / 4 + 4,
        0.0,
    )  # fp32: the shard is the master


# ------------------------------------------------------------------ activations
SBH = {"seq": 64, "batch": 8, "hidden": 256}


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_a_layers_activations_are_korthikantis(t: int) -> None:
    """Korthikanti et al. (2022), Table 2, with fused attention (no ``5 a s / h`` term) in
    fp16 with dropout: ``s b h (10 + 24/t)`` bytes a layer under tensor parallelism,
    ``34 s b h / t`` with sequence parallelism, ``2 s b h`` (the layer's input) with full
    recomputation. Exact: integers below 2**53."""
    model = ModelShape(layers=3, heads=8, vocab=1000, dropout=True, **SBH)
    s, b, h = SBH["seq"], 8, SBH["hidden"]
    tp = TPShape("1d", t)
    plain = activation_bytes(model, b, "fp16", ActivationShape(tp))
    sp = activation_bytes(model, b, "fp16", ActivationShape(tp, sequence_parallel=True))
    rc = activation_bytes(model, b, "fp16", ActivationShape(tp, recompute=True))
    assert len(plain) == model.layers + 2
    assert plain[1:-1] == [s * b * h * (10 + 24 / t)] * model.layers
    assert sp[1:-1] == [34 * s * b * h / t] * model.layers
    assert rc[1:-1] == [2 * s * b * h] * model.layers


act_args = {
    "layers": st.integers(1, 6),
    "hidden": st.sampled_from([32, 64, 96]),
    "heads": st.sampled_from([2, 4]),
    "vocab": st.integers(8, 5000),
    "seq": st.sampled_from([16, 32, 128]),
    "rows": st.floats(0.5, 64),
    "precision": st.sampled_from(PRECISIONS),
    "flash": st.booleans(),
    "dropout": st.booleans(),
    "mode": st.sampled_from([("1d", 2, 1), ("1d", 4, 1), ("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)]),
    "sp": st.booleans(),
    "cp": st.sampled_from([1, 2, 4]),
}


def _acts(
    *, layers: int, hidden: int, heads: int, vocab: int, seq: int, rows: float, precision: str, flash: bool,
    dropout: bool, shape: ActivationShape,
) -> list[float]:  # fmt: skip
    model = ModelShape(layers, hidden, heads, vocab, seq, batch=1, flash_attention=flash, dropout=dropout)
    return activation_bytes(model, rows, precision, shape)


@settings(max_examples=200, deadline=None)
@given(**act_args)
def test_recompute_sp_tp_and_cp_never_raise_a_blocks_activations(
    mode: tuple[str, int, int], sp: bool, cp: int, **model: object
) -> None:
    """Against the same rank without it: full recomputation (layers: only their input),
    Megatron sequence parallelism, tensor parallelism at all (``tp = 1``) and context
    parallelism (``cp = 1``) each keep no more of any block."""
    tp = TPShape(*mode)
    base = ActivationShape(tp, sp, cp, False)
    here = _acts(shape=base, **model)  # type: ignore[arg-type]
    for other in (
        dataclasses.replace(base, recompute=True),
        dataclasses.replace(base, sequence_parallel=True),
    ):
        fewer = _acts(shape=other, **model)  # type: ignore[arg-type]
        assert all(a <= b * (1 + REL) for a, b in zip(fewer, here, strict=True)), (other, fewer, here)
    for wider in (ActivationShape(TPShape(), sp, cp), ActivationShape(tp, sp, 1)):
        more = _acts(shape=wider, **model)  # type: ignore[arg-type]
        assert all(a <= b * (1 + REL) for a, b in zip(here, more, strict=True)), (wider, here, more)


@settings(max_examples=100, deadline=None)
@given(**act_args)
def test_activations_are_linear_in_the_rows_and_fused_attention_drops_the_scores(
    mode: tuple[str, int, int], sp: bool, cp: int, **model: object
) -> None:
    """Twice the rows keep twice the bytes (rel 1e-12: the same products, reassociated);
    unfused attention keeps ``a s^2 b`` probabilities more (and their dropout masks) in each
    layer, split like the rest of the region (``/ tp``)."""
    shape = ActivationShape(TPShape(*mode), sp, cp)
    rows = model.pop("rows")
    one = _acts(rows=rows, shape=shape, **model)  # type: ignore[arg-type]
    two = _acts(rows=2 * rows, shape=shape, **model)  # type: ignore[arg-type]
    assert two == pytest.approx([2 * x for x in one], rel=REL)
    model["flash"] = False
    unfused = _acts(rows=rows, shape=shape, **model)  # type: ignore[arg-type]
    model["flash"] = True
    fused = _acts(rows=rows, shape=shape, **model)  # type: ignore[arg-type]
    c, masks = DTYPE_BYTES[str(model["precision"])], 1.0 if model["dropout"] else 0.0
    s, seq = int(model["seq"]) / cp, int(model["seq"])  # type: ignore[call-overload]
    scores = int(model["heads"]) * s * seq * rows * (c + masks) / TPShape(*mode).tp  # type: ignore[call-overload]
    assert [u - f for u, f in zip(unfused[1:-1], fused[1:-1], strict=True)] == pytest.approx(
        [scores] * (len(fused) - 2),
        rel=1e-9,  # the difference of two sums: 1e-9 of the larger
    )
    assert unfused[0] == fused[0] and unfused[-1] == fused[-1]


# ------------------------------------------------------------------ parameters
def test_gpt2_small_has_its_parameters() -> None:
    """GPT-2 small (12 layers, d 768, vocab 50257, 1024 positions) has 124,439,808 parameters
    with its head tied to the embedding; this GPT's head is untied (a second vocab x d)."""
    gpt2 = ModelShape(layers=12, hidden=768, heads=12, vocab=50257, seq=1024, batch=1)
    assert gpt2.params - 50257 * 768 == 124_439_808
    blocks = gpt2.block_params()
    assert blocks[1:-1] == [12 * 768**2 + 13 * 768] * 12
    assert blocks[0] == (50257 + 1024) * 768 and blocks[-1] == 50257 * 768 + 2 * 768


shape_args = {
    "layers": st.integers(1, 6),
    "hidden": st.integers(1, 200),
    "vocab": st.integers(1, 3000),
    "seq": st.integers(1, 300),
    "ratio": st.integers(1, 4),
    "bias": st.booleans(),
}


def _model(layers: int, hidden: int, vocab: int, seq: int, ratio: int, bias: bool) -> ModelShape:
    return ModelShape(layers, hidden, 1, vocab, seq, batch=1, mlp_ratio=ratio, bias=bias)


@settings(max_examples=200, deadline=None)
@given(**shape_args, t=st.integers(1, 16), more=st.integers(1, 16))
def test_more_tensor_parallelism_never_gives_a_rank_more_of_a_block(t: int, more: int, **sizes: int) -> None:
    """1D at ``t`` and at ``t + more`` ranks: every block is no larger (ceil of a larger
    divisor); every 1D rank holds at least its ``1/t`` of the model and the tp ranks together
    at least the whole of it; at ``tp = 1`` the rank holds the serial model."""
    model = _model(**sizes)
    few = model.block_params(TPShape("1d", t))
    many = model.block_params(TPShape("1d", t + more))
    assert all(b <= a for a, b in zip(few, many, strict=True))
    assert sum(few) * t >= model.params
    assert model.block_params(TPShape("1d", 1)) == model.block_params()
    assert model.unsplit_params(TPShape("1d", 1)) == model.params


@settings(max_examples=200, deadline=None)
@given(
    **shape_args,
    grid=st.sampled_from(
        [("1d", 2, 1), ("1d", 4, 1), ("2d", 4, 1), ("2d", 9, 1), ("2.5d", 8, 2), ("3d", 8, 1)]
    ),
)
def test_split_parameters_divide_exactly_and_1d_keeps_only_what_it_names_whole(
    grid: tuple[str, int, int], **sizes: int
) -> None:
    """With every width a multiple of the ranks: 2D, 2.5D and 3D split every parameter
    ``ways`` ways (2.5D replicates over the depth), so ``ways`` ranks hold the model exactly;
    1D keeps whole what `unsplit_params` names (positions, LayerNorms) and the two row-parallel
    biases of each layer, and splits the rest ``tp`` ways. Exact (integers)."""
    shape = TPShape(*grid)
    lcm = 36 * 8  # a multiple of every tp and every ways here
    sizes |= {"hidden": sizes["hidden"] * lcm, "vocab": sizes["vocab"] * lcm}
    model = _model(**sizes)
    held = sum(model.block_params(shape))
    if shape.mode == "1d":
        whole = model.unsplit_params(shape) + 2 * int(model.bias) * model.hidden * model.layers
        assert held == whole + (model.params - whole) // shape.tp
        assert (model.params - whole) % shape.tp == 0
    else:
        assert model.unsplit_params(shape) == 0
        assert held * shape.ways == model.params
